"""Dead, stopped and disagreeing ranks make every other rank raise, quickly and clearly."""

import os
import time

import pytest

from ddl.engines import segments

from .util import hosts_env, reports, run_worker


def _survivors(results, victim):
    return [r for r in reports([x for x in results if x.rank != victim])]


@pytest.mark.parametrize("size", [1000, 3_000_000])
def test_killed_rank_makes_peers_raise(size):
    t = time.monotonic()
    results = run_worker("failures.py", 3, "kill", str(size), env=dict(DDL_TIMEOUT="60"))
    assert results[2].returncode == -9
    for r in _survivors(results, 2):
        assert r["kind"] == "DDLPeerError", r
        assert "rank 2" in r["msg"] and "died" in r["msg"] and "allreduce" in r["msg"]
        assert r["took"] < 5, "a dead peer must be noticed long before the timeout"
        assert r["later"] == "DDLError"
    assert time.monotonic() - t < 60


def test_rank_exiting_with_an_error_makes_peers_raise():
    results = run_worker("failures.py", 2, "exit", env=dict(DDL_TIMEOUT="60"))
    assert results[1].returncode == 3
    r = _survivors(results, 1)[0]
    assert r["kind"] == "DDLPeerError" and "rank 1" in r["msg"]
    assert r["took"] < 5


def test_stopped_rank_times_out(tmp_path):
    results = run_worker("failures.py", 3, "stop",
                         env=dict(DDL_TIMEOUT="1.5", VICTIM_PIDFILE=str(tmp_path / "pid")))
    survivors = _survivors(results, 2)
    # A survivor waits either on the stopped rank (and times out) or on the other survivor,
    # whose timeout turns into an abort it sees at once.
    timed_out = [r for r in survivors if r["kind"] == "DDLTimeoutError"]
    assert timed_out, survivors
    for r in timed_out:
        assert "timed out" in r["msg"] and "rank 2" in r["msg"] and "DDL_TIMEOUT" in r["msg"]
    for r in survivors:
        assert r["kind"] in ("DDLTimeoutError", "DDLPeerError"), r
        assert 1.4 < r["took"] < 10


def test_mismatched_calls_raise_on_every_rank_and_the_job_goes_on():
    reps = reports(run_worker("failures.py", 3, "mismatch"))
    for r in reps:
        for case, res in r["results"].items():
            assert res["kind"] == "DDLMismatchError", (r["rank"], case, res)
            assert "different arguments" in res["msg"]
            assert res["after"] == 3, f"engine unusable after the {case} mismatch"
    shape_msg = reps[0]["results"]["shape"]["msg"]
    assert "3x4" in shape_msg and "2x6" in shape_msg


@pytest.mark.parametrize("n,per", [(3, None), (4, 2)], ids=["shm-3", "2 hosts of 2"])
def test_grouped_calls_that_split_differently_raise_on_every_rank(n, per):
    """Rank 0 grouping [100, 200] elements and the others [200, 100] (the same total) used
    to reduce every rank's first tensor with parts of the others' second, silently."""
    reps = reports(run_worker("failures.py", n, "grouped_mismatch",
                              env=dict(DDL_TIMEOUT="20"),
                              per_rank_env=hosts_env(n, per) if per else None))
    for r in reps:
        for case, res in r["results"].items():
            assert res["kind"] == "DDLMismatchError", (r["rank"], case, res)
            assert res["after"] == n * (n - 1) // 2, f"out of step after the {case} mismatch"
        assert r["same"] == [n, 2 * n, n, 2 * n], r
    if per is None:  # the shared-memory engine's report shows every rank's layout
        msg = reps[0]["results"]["split"]["msg"]
        assert "100+200 in 2 tensors" in msg and "200+100 in 2 tensors" in msg, msg


def test_bad_input_is_refused_locally():
    for r in reports(run_worker("failures.py", 2, "bad_input")):
        res = r["results"]
        assert all(v["kind"] == "DDLConfigError" for v in res.values()), res
        assert "Average is not defined for int32" in res["avg_int"]["msg"]
        assert "numpy arrays or torch tensors" in res["list"]["msg"]
        assert "root_rank 2" in res["root"]["msg"]
        assert r["after"] == 2.0


@pytest.mark.parametrize("n,per,mode", [
    (2, None, ""), (3, None, ""), (2, 1, ""), (4, 2, "-mode r:2x2"), (4, 2, ""),
    (4, 1, "-mode r:2x2"), (8, 2, "-mode r:2x2x2")],
    ids=["shm-2", "shm-3", "2 hosts", "2 hosts of 2", "2 hosts of 2, flat",
         "2x2 grid across hosts", "4 hosts of 2, 3-D grid"])
def test_a_call_refused_on_one_rank_raises_on_every_rank_and_the_job_stays_in_step(n, per,
                                                                                 mode):
    """The refusing rank's error used to stay its own: its next call paired with the peers'
    pending one, and every later result was the wrong partner's, silently."""
    env = {"DDL_TIMEOUT": "20", **({"DDL_OPTIONS": mode} if mode else {})}
    reps = reports(run_worker("refused_call.py", n, env=env,
                              per_rank_env=hosts_env(n, per) if per else None))
    why = {"int_average": "Average is not defined for int32", "bad_out": "out has float32[15]",
           "bad_root": f"root_rank {n} is outside", "rows": "tensor is a scalar",
           "root_type": "root_rank must be an int, got None",
           "grouped": "Average is not defined for int32"}
    for r in reps:
        refusing = r["rank"] == n - 1
        for case, text in why.items():
            if refusing:
                assert r[case] == "DDLConfigError" and text in r[f"{case}_msg"], (r, case)
            else:
                assert r[case] == "DDLMismatchError", (r["rank"], case, r[case])
            assert r[f"{case}_after"], (r["rank"], case)
        assert r["everyone"] == "DDLConfigError" and r["everyone_after"], r
    # the engines name the refusal: the shared-memory engine, and the round across hosts
    named = ("some ranks refused allreduce" if per is None
             else "refused this call before its data moved")
    assert named in reps[0]["int_average_msg"], reps[0]["int_average_msg"]


def test_sigkilled_job_leaves_only_what_cleanup_job_removes():
    """A rank killed before every peer attached leaves the control segment; the launcher's
    cleanup path (keyed by job id) removes it and any heap segments."""
    job = "leaktest" + str(os.getpid())
    token = segments.segment_token(job, None)
    name = segments.segment_name(job, 0, "ctl")
    mm = segments.create(name, 4096, token)
    mm.close()
    heap = segments.segment_name(job, 0, "heap1-0")
    segments.create(heap, 4096, token).close()
    other = segments.segment_name(job + "x", 0, "ctl")
    segments.create(other, 4096, segments.segment_token(job + "x", None)).close()
    try:
        assert set(segments.cleanup_job(job)) == {name, heap}
        assert segments.list_job(job) == []
        assert segments.list_job(job + "x") == [other]
    finally:
        segments.cleanup_job(job + "x")


def test_small_dev_shm_fails_with_a_message_naming_the_fix():
    with pytest.raises(segments.DDLShmError, match="--shm-size"):
        segments.create("ddl-toolarge-h0-ctl", 1 << 50, 1)
    assert not os.path.exists("/dev/shm/ddl-toolarge-h0-ctl")


def test_init_gives_up_on_a_peer_that_never_attaches():
    """(Two jobs with one id are refused in test_job_isolation.py.)"""
    t = time.monotonic()
    results = run_worker("hold.py", 1, env=dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                                DDL_INIT_TIMEOUT="2"))
    r = results[0]
    assert r.returncode == 1
    assert "DDLTimeoutError" in r.stderr and "local rank 1 did not attach" in r.stderr
    assert time.monotonic() - t < 15


def test_init_waits_as_long_as_ddl_timeout_when_no_init_timeout_is_given():
    t = time.monotonic()
    r = run_worker("hold.py", 1, env=dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                          DDL_TIMEOUT="1.5"))[0]
    assert r.returncode == 1 and "within 1.5s" in r.stderr, r.stderr
    assert time.monotonic() - t < 12
