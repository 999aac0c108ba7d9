"""Named calls are matched by name, in any order, as Horovod's coordinator matches them
(ddl/hvd/named.py): 2 and 3 ranks on one host and 4 ranks on two (simulated) hosts, every
part in one job with no shutdown between them, as Horovod's CI runs its tests. The parts are
workers/hvd_named.py's."""

import os

import pytest
from torch_util import WORKERS, ddlrun, reports, run_worker

from tests.core.util import hosts_env


@pytest.fixture(scope="module", params=[2, 3, "2x2"])
def job(request):
    env = {"DDL_TIMEOUT": "30", "SOAK": "1000"}
    if request.param == "2x2":
        return 4, reports(run_worker("hvd_named.py", 4, env=env, timeout=400,
                                     per_rank_env=hosts_env(4, 2, DDL_OPTIONS="-mode r:2x2")))
    n = request.param
    return n, reports(run_worker("hvd_named.py", n, env=env, timeout=400))


def _part(rep: dict, key: str) -> dict:
    got = rep[key]
    assert "exception" not in got, got["exception"]
    return got


@pytest.mark.timeout(450)
def test_horovods_duplicate_name_tests_pass_in_one_job(job):
    """Rank 0 submits before a barrier, the others after it; the second use raises
    ValueError on the rank that makes it, and the job stays in step for every kind."""
    _, reps = job
    for rank, rep in enumerate(reps):
        for kind, got in _part(rep, "horovod_duplicates").items():
            if kind == "seconds":
                continue
            assert got["raised"] == [True] and got["in_step"], (rank, kind, got)


@pytest.mark.timeout(450)
def test_named_calls_submitted_and_waited_in_any_order_are_right(job):
    _, reps = job
    for rep in reps:
        got = _part(rep, "any_order")
        assert got["wrong"] == [] and got["in_step"], got


@pytest.mark.timeout(450)
def test_one_name_with_another_shape_raises_on_every_rank_and_the_job_goes_on(job):
    n, reps = job
    for rep in reps:
        got = _part(rep, "shape_mismatch")
        assert got["error"] is not None and "name='mismatch'" in got["error"], got
        assert f"float32[{3 + 1}]" in got["error"] and "float32[3]" in got["error"], got
        assert got["in_step"]


@pytest.mark.timeout(450)
def test_named_calls_between_unnamed_ones_at_other_points_and_polled_ones(job):
    _, reps = job
    for rep in reps:
        assert _part(rep, "mixed")["ok"] and rep["mixed"]["in_step"], rep["mixed"]
        assert _part(rep, "polled")["ok"] and rep["polled"]["in_step"], rep["polled"]


@pytest.mark.timeout(450)
def test_soak_of_named_calls_in_per_rank_order_unnamed_ones_and_one_rank_errors(job):
    """Zero wrong results, every injected error raised on every rank, zero hangs."""
    _, reps = job
    for rep in reps:
        got = _part(rep, "soak")
        assert got["wrong"] == [], got["wrong"][:10]
        assert got["errors"] == got["expected_errors"] > 0 and got["in_step"], got


@pytest.mark.timeout(120)
def test_a_stalled_name_warns_then_fails_on_every_rank_together():
    env = {"NAMED_STALL": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3", "DDL_TIMEOUT": "30"}
    results = run_worker("hvd_named.py", 2, env=env, timeout=90)
    reps = reports(results)
    for rank, (res, rep) in enumerate(zip(results, reps)):
        got = _part(rep, "stall")
        other = 1 - rank
        assert got["error"] is not None and "stalled" in got["error"], got
        assert f"ranks {other} never submitted it" in got["error"], got
        assert got["in_step"] and 2.5 < got["seconds"] < 30, got
        assert f"name='only.{rank}'" in res.stderr and "still waits for ranks" in res.stderr


def test_a_shutdown_ends_the_named_calls_that_wait_for_the_leaving_rank():
    # the worker's rank 0 waits on a name rank 1 never submits; rank 1 shuts down
    res = ddlrun(2, [os.path.join(WORKERS, "named_shutdown.py")], timeout=120,
                 env={"DDL_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[0] rank 0 raised DDLPeerError: rank 0: rank(s) 1 called hvd.shutdown() while " \
        "this named call waited for them" in res.stdout, res.stdout
    assert "[1] rank 1: shutdown returned" in res.stdout
    for r in (0, 1):
        assert f"[{r}] rank {r} sum [2.0, 2.0]" in res.stdout, res.stdout
