"""Elastic TensorFlow and Keras jobs under ddlrun that lose a worker, real processes:
examples/elastic_keras.py (``model.fit`` with Horovod's elastic callbacks) and a TF2
custom loop with ``TensorFlowKerasState`` (workers/elastic_tf_loop.py) both re-form the
world with the survivors, go on from the last commit and complete.

TensorFlow costs seconds per process here: two ddlrun jobs in all."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

# Not importorskip: the workers import TensorFlow, this module need not pay for it.
if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None:
    pytest.skip("needs tensorflow and keras", allow_module_level=True)

from procs import run_ddlrun  # noqa: E402 - after the skip

pytestmark = [pytest.mark.slow, pytest.mark.tensorflow]

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "elastic_keras.py")
LOOP = os.path.join(HERE, "workers", "elastic_tf_loop.py")
ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore", "KERAS_BACKEND": "tensorflow"}
ELASTIC = ["-np", "3", "--min-np", "2", "--max-np", "3"]


def elastic_job(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    p = run_ddlrun(*ELASTIC, sys.executable, *argv, timeout=420, cwd=str(tmp_path),
                   env={**os.environ, **ENV})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p


def assert_lost_and_resumed(p: subprocess.CompletedProcess, worker: str, commit: int) -> None:
    """ddlrun's lines: world 0 of 3, the worker lost, world 1 of 2 going on from the
    commit, and no other world."""
    said = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("ddlrun: ")]
    assert said[0].startswith("ddlrun: world 0 (start): 3 ranks"), said
    failed = [ln for ln in said if f"worker {worker} " in ln]
    assert len(failed) == 1 and "failed" in failed[0] and "SIGKILL" in failed[0], said
    assert any(re.match(r"ddlrun: world 1 \(.*\): 2 ranks", ln) for ln in said), said
    assert f"ddlrun: world 1 goes on from commit {commit} (restored)" in said, said
    assert not any("world 2" in ln for ln in said), said


def test_keras_fit_with_the_elastic_callbacks_survives_a_lost_worker(tmp_path):
    # 6 batches an epoch, a commit every 2: the worker dies after batch 3, one past commit 1
    p = elastic_job(tmp_path, EXAMPLE, "--epochs", "3", "--steps", "6",
                    "--batches-per-commit", "2", "--fail-worker", "localhost:1",
                    "--fail-at-batch", "3")
    assert_lost_and_resumed(p, "localhost:1", 1)
    final = [ln for ln in p.stdout.splitlines() if ln.startswith("[0] FINAL ")]
    assert len(final) == 1, p.stdout[-4000:]
    result = dict(pair.split("=", 1) for pair in final[0].split()[2:])
    assert (result["epochs"], result["size"]) == ("3", "2")
    assert float(result["loss"]) == float(result["loss"])  # trained to a number, not NaN


def test_a_tf2_custom_loop_with_tensorflow_keras_state_survives_a_lost_worker(tmp_path):
    # 12 batches, a commit every 3: the worker dies after batch 7, one past commit 2
    p = elastic_job(tmp_path, LOOP, "12", "3", "localhost:2", "7")
    assert_lost_and_resumed(p, "localhost:2", 2)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[0] RESULT ")]
    assert len(lines) == 1, p.stdout[-4000:]
    result = json.loads(lines[0].split(" ", 2)[2])
    # back to batch 6 from 7, then to the end in a world of 2: commits 3 and 4 after it
    assert (result["batch"], result["commits"], result["size"]) == (12, 4, 2)
    assert result["sizes"] == [2]  # the reset callback ran once, in the new world
    assert result["lr"] == pytest.approx(0.02)  # and scaled lr to it
