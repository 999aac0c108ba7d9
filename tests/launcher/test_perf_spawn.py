"""ddl-perf's local ranks (``ddl.perf.spawn``) are a ddlrun job: ddlrun's env contract,
its process set and its supervisor. With fail_fast (ddl-perf) the first failing rank takes
the others down at once and its code is the job's; without (the tests) every rank runs to
its end."""

import os
import signal
import sys
import time

import pytest
from ddlrun_testlib import HERE

from ddl.perf.spawn import local_plan, run_job
from ddlrun import envs

SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
print("rank", rank, "of", os.environ["WORLD_SIZE"], flush=True)
if rank == 1:
    time.sleep(0.3)
    sys.exit(7)
time.sleep(60)
"""
DIE_EARLY = str(HERE / "scripts" / "die_early")


def test_plan_carries_ddlruns_contract_with_overrides():
    plan = local_plan(2, ["w.py"], "jspawn", 29600, env={"X_TEST": "1"},
                      per_rank_env=[{}, {envs.MASTER_PORT: "1"}])
    rank0, rank1 = (r.env_dict() for r in plan.ranks)
    assert plan.program == (sys.executable, "w.py")
    assert rank0[envs.RANK] == "0" and rank1[envs.LOCAL_RANK] == "1"
    assert rank0[envs.WORLD_SIZE] == "2" and rank0[envs.DDL_JOB_ID] == "jspawn"
    assert rank0[envs.MASTER_ADDR] == "127.0.0.1" and rank0[envs.MASTER_PORT] == "29600"
    assert rank1[envs.MASTER_PORT] == "1" and rank1["X_TEST"] == "1"
    assert envs.DDL_OPTIONS not in rank0  # the core's default mode applies


def test_fail_fast_stops_the_others_at_once_with_the_failing_code(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    t = time.monotonic()
    job = run_job(3, [str(script)], fail_fast=True, grace=2, timeout=60)
    took = time.monotonic() - t
    assert job.code == 7 and job.first_failure == 1
    assert [r.returncode for r in job.ranks] == [-signal.SIGTERM, 7, -signal.SIGTERM]
    assert job.ranks[2].stdout == "rank 2 of 3\n"
    assert took < 20, f"the survivors were not stopped at once ({took:.1f}s)"


def test_without_fail_fast_every_rank_runs_to_its_end(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT.replace("time.sleep(60)", "time.sleep(1.0); print('done')"))
    job = run_job(2, [str(script)], timeout=60)
    assert job.code == 7 and job.first_failure == 1
    assert job.ranks[0].returncode == 0 and job.ranks[0].stdout.endswith("done\n")


@pytest.mark.slow
def test_perf_train_ranks_exits_fast_with_the_dead_ranks_code():
    """``benchmarks/train_side_by_side.py --ranks 2`` (ddl-perf's spawn): rank 1 dies at
    start; rank 0, which would wait DDL_TIMEOUT (120 s) for it at init, is stopped at once."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (DIE_EARLY, os.environ.get("PYTHONPATH")) if p),
        "DDLTEST_DIE_RANK": "1", "DDLTEST_DIE_CODE": "9", "DDL_TIMEOUT": "120"}
    t = time.monotonic()
    script = str(HERE.parent.parent / "benchmarks" / "train_side_by_side.py")
    res = subprocess.run([sys.executable, script, "--ranks", "2", "--steps",
                          "1", "--warmup", "0", "--rounds", "1", "--timeout", "200"],
                         env=env, capture_output=True, text=True, timeout=200)
    took = time.monotonic() - t
    assert res.returncode == 9, res.stderr[-3000:]
    assert "rank 1 on host localhost" in res.stderr and "exited with code 9" in res.stderr
    assert took < 60, f"took {took:.1f}s: rank 0 was not stopped when rank 1 died"
