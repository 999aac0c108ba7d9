"""Elastic training's TensorFlow and Keras side (ddl.keras_elastic, ddl.tensorflow.elastic,
ddl.keras.elastic): the states' save, restore and sync, the model.fit callbacks, and a
TensorFlow error caused by a lost peer taken for HorovodInternalError.

Two worker runs serve every test (importing TensorFlow costs seconds per process): one
1-rank process with no launcher, and one 2-rank job under ddlrun
(workers/elastic_tf.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# Not importorskip: importing TensorFlow here would cost every run that merely collects
# this file several seconds; the workers import it.
if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None:
    pytest.skip("needs tensorflow and keras", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.tensorflow]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "elastic_tf.py")
ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "3", "DDL_TIMEOUT": "60", "PYTHONWARNINGS": "ignore",
       "KERAS_BACKEND": "tensorflow"}


def _reports(p: subprocess.CompletedProcess, ranks: int) -> list[dict]:
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    reps = sorted((json.loads(line[line.index("{"):]) for line in p.stdout.splitlines()
                   if '"rank":' in line), key=lambda r: r["rank"])
    assert [r["rank"] for r in reps] == list(range(ranks)), out[-4000:]
    return reps


@pytest.fixture(scope="module")
def single() -> dict:
    """The 1-rank report (a world of one: no launcher's variables)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "DDL_ELASTIC"))}
    p = subprocess.run([sys.executable, WORKER, "single"], capture_output=True, text=True,
                       timeout=300, env={**env, **ENV})
    return _reports(p, 1)[0]


def section(report: dict, name: str) -> dict:
    part = report[name]
    assert "error" not in part, part.get("error")
    return part


def test_keras_state_restores_weights_and_adam_slots_bit_for_bit(single):
    s = section(single, "keras_state")
    # an optimizer with no variables yet is built when the state is made
    assert not s["built_before"] and s["built"] and s["opt_vars"] == 10
    assert s["slots"] == 8 and s["slots_nonzero"]  # Adam's m and v of 4 variables, trained
    assert s["changed"] and s["restored"]
    assert s["epoch"] == 2  # the plain value committed with them


def test_tensorflow_state_restores_variables_and_refuses_tf1(single):
    s = section(single, "tf_state")
    assert s["restored"] and s["a"] == [1.5, 2.25, 3.125] and s["b"] == [[4, 5]]
    assert s["step"] == 3
    assert "TF1 sessions" in s["session"]
    assert "pass the tf.Variables" in s["no_variables"]


def _relative(run: dict) -> tuple[list, list]:
    """The recorded (state.batch, commits) and (epoch, batch, commits), commits counted
    from the fit's start."""
    first = run["first"]
    batches = [[[b, c - first] for b, c in epoch] for epoch in run["batches"]]
    epochs = [[e, b, c - first] for e, b, c in run["epochs"]]
    return batches, epochs


def test_fit_callbacks_commit_and_track_batch_and_epoch(single):
    run = section(single, "callbacks")["fresh"]
    batches, epochs = _relative(run)
    # 5 batches an epoch, a commit every 2 batches (counted across epochs, as Horovod's)
    # and at every epoch's end
    assert batches == [[[1, 0], [2, 1], [3, 1], [4, 2], [5, 2]],
                       [[1, 4], [2, 4], [3, 5], [4, 5], [5, 6]],
                       [[1, 7], [2, 8], [3, 8], [4, 9], [5, 9]]]
    assert epochs == [[1, 0, 3], [2, 0, 7], [3, 0, 10]]
    assert run["commits"] == 15 // 2 + 3 and (run["epoch"], run["batch"]) == (3, 0)


def test_a_restart_mid_epoch_runs_only_the_batches_left(single):
    """Restarted at epoch 1 with 3 of its 5 batches done: that epoch runs 2 batches, the
    next runs whole, and training ends at epoch 3 as without the restart."""
    run = section(single, "callbacks")["restarted"]
    batches, epochs = _relative(run)
    assert batches == [[[4, 0], [5, 1]], [[1, 2], [2, 3], [3, 3], [4, 4], [5, 4]]]
    assert epochs == [[2, 0, 2], [3, 0, 5]]
    assert (run["epoch"], run["batch"]) == (3, 0)


def test_a_tensorflow_error_from_a_lost_peer_is_a_horovod_internal_error(single):
    s = section(single, "error")
    # outside an elastic job the loop cannot re-form the world: the error comes out
    assert s["peer"] == {"raised": "HorovodInternalError", "internal": True,
                         "cause_is_original": True, "same": False}
    # an error of the program's own is left alone
    assert s["other"] == {"raised": "InvalidArgumentError", "internal": False,
                          "cause_is_original": False, "same": True}


def test_sync_makes_every_rank_rank_zeros_state():
    p = subprocess.run([sys.executable, "-m", "ddlrun", "-n", "2", sys.executable, WORKER,
                        "sync"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **ENV})
    reps = [section(r, "sync") for r in _reports(p, 2)]
    assert reps[0]["before"] != reps[1]["before"]  # model and Adam slots differed
    assert reps[0]["after"] == reps[0]["before"]  # rank 0 kept its own
    assert reps[1]["after"] == reps[0]["before"]
    for r in reps:
        assert (r["batch"], r["epoch"], r["note"]) == (0, 5, "rank 0")
        assert r["var"] == [0.0, 0.0, 0.0] and r["restored"]
