"""ddl.torch across real processes: the "ddl" torch.distributed backend against gloo, the
Horovod-compatible API and DistributedOptimizer against one big-batch process, failures,
a Horovod-style script (our rewrite of Horovod's MNIST example) and an unchanged torchrun
script under ddlrun."""

import os

import pytest
import torch
from torch_util import EXAMPLES, WORKERS, ddlrun, reports, run_worker

TIGHT = 1e-6  # DDP on ddl vs gloo, and fp32 DistributedOptimizer vs one process
FP16 = 1e-3  # float16 gradients: ~3 significant digits


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ddp_on_ddl_matches_ddp_on_gloo_and_collectives_work(n):
    reps = reports(run_worker("ddp_backend.py", n))
    for r in reps:
        assert r["failed"] == [], r
        assert r["diff"] <= TIGHT
    if n == 2:  # one addition per element: the same order as gloo, so bitwise equal
        assert all(r["bitwise"] for r in reps)


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_distributed_optimizer_equals_one_process_with_the_whole_batch(n):
    for r in reports(run_worker("hvd_optimizer.py", n)):
        d = r["diff"]
        for case, value in d.items():
            limit = FP16 if "fp16" in case else TIGHT
            assert value <= limit, (case, value)
        # the settings did change the plans they were meant to change
        b = r["buckets"]
        assert b["no_fusion"] > b["small_buckets"] > b["num_groups"] == 2
        # CPU gradients are never packed: fresh ones are reduced where they live; kept ones
        # are summed into the fusion buffers once, then reduced there in place
        m = r["modes"]
        assert {x for step in m["default"] for x in step} == {"grads"}, m["default"]
        for kept in ("kept_grads", "kept_grads_accumulate"):
            assert [set(step) for step in m[kept]] == [{"grads"}, {"into"}, {"buffer"},
                                                       {"buffer"}], (kept, m[kept])
        assert {x for step in m["fp16"] for x in step} == {"packed"}  # cast on the way


def test_horovod_api_and_broadcasts():
    for r in reports(run_worker("hvd_api.py", 2)):
        assert r["failed"] == [], r


@pytest.mark.parametrize("mode", ["hvd", "ddp"])
def test_a_dead_rank_makes_the_others_raise_a_ddl_error(mode):
    results = run_worker("train_fail.py", 2, mode, env={"DDL_TIMEOUT": "20"}, timeout=90)
    assert results[1].returncode == 3
    survivor = reports(results[:1], check_rc=False)[0]
    assert results[0].returncode == 1
    assert survivor["is_ddl"], survivor
    text = " ".join(survivor["chain"])
    assert "DDLPeerError" in text and "rank 1" in text and "allreduce" in text
    assert survivor["seconds"] < 15  # detected, not timed out


def test_ddlrun_exits_non_zero_when_a_rank_fails():
    proc = ddlrun(2, [os.path.join(WORKERS, "train_fail.py"), "hvd"], timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_horovod_style_mnist_example_trains_under_ddlrun():
    proc = ddlrun(2, [os.path.join(EXAMPLES, "torch_horovod_mnist.py"), "--epochs", "1",
                      "--num-samples", "512", "--fp16-allreduce"], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "final accuracy" in proc.stdout


def test_a_torchrun_style_gloo_script_runs_unchanged_under_ddlrun():
    proc = ddlrun(2, [os.path.join(WORKERS, "torchrun_style.py")], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln.split("] ", 1)[-1] for ln in proc.stdout.splitlines() if "{" in ln]
    import json

    reps = sorted((json.loads(ln[ln.index("{"):]) for ln in lines), key=lambda r: r["rank"])
    assert [r["rank"] for r in reps] == [0, 1]
    assert all(r["identical"] and r["backend"] == "gloo" and r["world"] == 2 for r in reps)
    assert [r["local_rank"] for r in reps] == [0, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
def test_cuda_gradients_through_distributed_optimizer():  # pragma: no cover - no GPU here
    for r in reports(run_worker("hvd_optimizer.py", 2, env={"DDL_TEST_DEVICE": "cuda"})):
        assert all(v <= FP16 for v in r["diff"].values())
