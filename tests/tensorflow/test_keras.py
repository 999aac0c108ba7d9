"""ddl.keras and ddl.tensorflow across real processes: Keras 3 model.fit on 2 and 4 ranks
against one process with the whole batch (tensorflow and torch backends), save and load, a
DistributedGradientTape loop, gradient accumulation against a hand-computed reference, the
learning-rate callbacks against their formulas, jit_compile, ranks out of step, and the
examples under ddlrun.

One worker run per backend does most of the checks (importing TensorFlow costs seconds per
process); the tests below read its report, section by section.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from procs import reports, run_ddlrun, run_workers

# Not importorskip: importing TensorFlow here would cost every pytest run that merely
# collects this file several seconds; the workers import it.
if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None:
    pytest.skip("needs tensorflow and keras", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.tensorflow]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLES = os.path.join(ROOT, "examples")
ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "3", "DDL_TIMEOUT": "20", "PYTHONWARNINGS": "ignore"}
TIGHT = 1e-5  # relative: 2 ranks x batch B against one process x batch 2B, float32
TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
# (backend, ranks): each worker run serves every test of its id
RUNS = [pytest.param(("tensorflow", 2), id="tensorflow-2"),
        pytest.param(("torch", 2), id="torch-2", marks=TORCH),
        pytest.param(("tensorflow", 4), id="tensorflow-4")]
TF_RUNS = [r for r in RUNS if r.values[0][0] == "tensorflow"]
WARNING = "ddl.keras: XLA cannot compile ddl's collectives; training with jit_compile=False"
STEPS = 3  # keras_common.STEPS: batches per epoch in the lr section


def run_worker(name: str, *args: str, ranks: int = 2, env: dict | None = None,
               timeout: float = 300) -> list[dict]:
    """Run a worker on ``ranks`` ranks; every rank's last JSON line (fails with all output)."""
    return reports(run_workers(os.path.join(WORKERS, name), ranks, *args,
                               env={**ENV, **(env or {})}, timeout=timeout))


_RUNS: dict[tuple[str, int], tuple[list[dict], str]] = {}


def train_run(run: tuple[str, int], tmp_path_factory) -> list[dict]:
    """keras_train.py's report on each rank for ``run`` = (backend, ranks), run once per
    session."""
    if run not in _RUNS:
        backend, ranks = run
        where = str(tmp_path_factory.mktemp(f"keras-{backend}-{ranks}"))
        _RUNS[run] = (run_worker("keras_train.py", where, ranks=ranks,
                                 # 4 TensorFlow ranks tracing on 2 busy cores can
                                 # keep a peer waiting past 20 s: not what is tested here
                                 env={"KERAS_BACKEND": backend, "DDL_TIMEOUT": "90"},
                                 timeout=300 + 150 * (ranks - 2)), where)
    return _RUNS[run][0]


def section(run: tuple[str, int], name: str, tmp_path_factory) -> list[dict]:
    reps = train_run(run, tmp_path_factory)
    assert [r["rank"] for r in reps] == list(range(run[1]))
    for r in reps:
        assert r["backend"] == run[0]
        assert "error" not in r[name], f"rank {r['rank']}:\n{r[name]['error']}"
    return [r[name] for r in reps]


def assert_same_on_every_rank(parts: list[dict], key: str = "digest") -> None:
    assert len({p[key] for p in parts}) == 1, "the ranks' weights differ"


@pytest.mark.parametrize("run", RUNS)
def test_fit_gives_identical_weights_equal_to_one_process(run, tmp_path_factory):
    fit = section(run, "fit", tmp_path_factory)
    assert_same_on_every_rank(fit)
    for part in fit:
        assert part["distributed"]
        assert part["vs_one_process"] <= TIGHT, part["vs_one_process"]


@pytest.mark.parametrize("run", RUNS)
def test_metric_average_callback_averages_the_epoch_logs(run, tmp_path_factory):
    fit = section(run, "fit", tmp_path_factory)
    local = [p["local_loss"] for p in fit]
    assert len({tuple(x) for x in local}) == len(local)  # each rank's own data: own losses
    for part in fit:
        mean = [sum(xs) / len(xs) for xs in zip(*local)]
        assert part["averaged_loss"] == pytest.approx(mean, rel=1e-6)
        assert part["history_loss"] == part["averaged_loss"]


@pytest.mark.parametrize("run", RUNS)
def test_load_model_restores_a_distributed_optimizer_with_its_state(run, tmp_path_factory):
    saved = section(run, "save", tmp_path_factory)
    assert_same_on_every_rank(saved)
    for part in saved:
        assert part["distributed"] and part["same_on_load"]
        assert part["cls"] == "SGD" and part["module"].startswith("keras.")
        # 2 epochs of 3 steps before saving, one more epoch after loading
        assert part["iterations"] == 3 * STEPS
        # the loaded model trained on exactly as the one that was saved (momentum kept)
        assert part["vs_continued_original"] == 0.0


def test_plain_keras_loads_the_saved_file_without_ddl(tmp_path_factory):
    section(("tensorflow", 2), "save", tmp_path_factory)
    path = os.path.join(_RUNS[("tensorflow", 2)][1], "m.keras")
    code = ("import json, sys, keras\n"
            f"m = keras.models.load_model({path!r})\n"
            "o = m.optimizer\n"
            "print(json.dumps(dict(cls=type(o).__name__, module=type(o).__module__,\n"
            "    iterations=int(o.iterations.numpy()), layers=len(m.layers),\n"
            "    ddl=sorted(k for k in sys.modules if k == 'ddl' or k.startswith('ddl.')))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **ENV,
                                            "KERAS_BACKEND": "tensorflow"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == dict(cls="SGD", module="keras.src.optimizers.sgd", iterations=2 * STEPS,
                       layers=2, ddl=[])


@pytest.mark.parametrize("run", TF_RUNS)
def test_distributed_gradient_tape_in_a_tf_function_equals_one_process(run, tmp_path_factory):
    tape = section(run, "tape", tmp_path_factory)
    assert_same_on_every_rank(tape)
    for part in tape:
        assert part["vs_one_process"] <= TIGHT, part["vs_one_process"]
        assert part["traced"] == 1  # one graph for every step


@pytest.mark.parametrize("run", RUNS)
def test_backward_passes_per_step_applies_the_sum_or_the_average(run, tmp_path_factory):
    acc = section(run, "accumulation", tmp_path_factory)
    for kind in ("sum", "average"):
        assert_same_on_every_rank([p[kind] for p in acc])
        for part in acc:
            assert part[kind]["vs_hand"] <= TIGHT, (kind, part[kind]["vs_hand"])
            assert part[kind]["iterations"] == 2  # 4 backward passes, 2 updates
    assert acc[0]["references_apart"] > 100 * TIGHT  # sum and average can be told apart


def expected_warmup(lr: float, n: int, warmup_epochs: int, epochs: int) -> list[float]:
    """Goyal et al.: lr/n rising linearly to lr over warmup_epochs, per batch."""
    out = []
    for epoch in range(epochs):
        for batch in range(STEPS):
            e = epoch + batch / STEPS
            out.append(lr / n * (e * (n - 1) / warmup_epochs + 1) if e < warmup_epochs
                       else lr)
    return out


@pytest.mark.parametrize("run", RUNS)
def test_learning_rate_warmup_follows_goyal_et_al(run, tmp_path_factory):
    n = run[1]
    lr0 = 0.1 * n  # keras_train.py: the base rate 0.1 scaled by the ranks, as Goyal et al.
    for part in section(run, "lr", tmp_path_factory):
        assert part["steps"] == STEPS
        assert part["warmup"] == pytest.approx(expected_warmup(lr0, n, 2, 3), rel=1e-6)
        assert part["warmup"][0] == pytest.approx(0.1)  # initial_lr / size
        # the epoch's logs carry the rate of the epoch's last batch (epoch 2/3 of 2 warmup
        # epochs); warmup ends exactly at initial_lr
        assert part["warmup_epoch_lr"] == pytest.approx(
            [lr0 / n * (1 + 2 / 3 * (n - 1) / 2), lr0, lr0], rel=1e-6)


@pytest.mark.parametrize("run", RUNS)
def test_learning_rate_schedule_staircase_and_smooth(run, tmp_path_factory):
    for part in section(run, "lr", tmp_path_factory):
        # 0.2 * 0.5**epoch on epochs [1, 3), then the constant multiplier 0.01 from epoch 3
        stair = [0.2] * STEPS + [0.1] * STEPS + [0.05] * STEPS + [0.002] * STEPS
        assert part["staircase"] == pytest.approx(stair, rel=1e-6)
        smooth = [0.2 / (1 + e + b / STEPS) for e in range(2) for b in range(STEPS)]
        assert part["smooth"] == pytest.approx(smooth, rel=1e-6)


@pytest.mark.parametrize("run", TF_RUNS)
def test_jit_compile_is_turned_off_with_one_warning(run, tmp_path_factory):
    xla = section(run, "xla", tmp_path_factory)
    assert_same_on_every_rank(xla)
    for part in xla:
        assert part["warnings"] == [WARNING]
        assert part["jit_compile"] is False and part["finite"]


@pytest.mark.parametrize("case", ["shapes", "steps"])
def test_ranks_out_of_step_raise_ddl_errors_on_every_rank(case):
    reps = run_worker("keras_fail.py", case, env={"KERAS_BACKEND": "tensorflow"},
                      timeout=120)
    for r in reps:
        assert r["raised"], r
        text = "\n".join(r["chain"])
        assert "DDLMismatchError" in text and "different collectives" in text
        assert r["seconds"] < 15, r["seconds"]  # found by negotiation, not by DDL_TIMEOUT
        if case == "shapes":  # raised inside the tf.function: a TF error with ddl's text
            assert r["is_tf_error"], r["type"]
            assert "float32[3]" in text and "float32[4]" in text
        else:  # rank 0's gradients met rank 1's MetricAverageCallback
            assert "grouped_allreduce(4 tensors" in text and "float64[1]" in text


def ddlrun(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return run_ddlrun("-n", "2", sys.executable, *argv, timeout=timeout,
                      env={**os.environ, **ENV, "KERAS_BACKEND": "tensorflow"})


@pytest.mark.parametrize("example,floor", [("keras_digits.py", 0.5),
                                           ("tf_custom_loop.py", 0.5)])
def test_examples_train_through_ddlrun(example, floor, tmp_path):
    ckpt = tmp_path / "digits.keras"
    argv = [os.path.join(EXAMPLES, example), "--epochs", "2"]
    if example == "keras_digits.py":
        argv += ["--checkpoint", str(ckpt)]
    proc = ddlrun(argv)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    found = re.findall(r"^\[(\d+)\][^\n]*final accuracy: ([0-9.]+)", proc.stdout, re.M)
    assert [rank for rank, _ in found] == ["0"], out[-4000:]  # printed by rank 0 only
    assert float(found[0][1]) > floor, found
    if example == "keras_digits.py":
        assert ckpt.is_file()
