"""Every collective against numpy, with real processes on the shared-memory engine."""

import pytest

from .util import cma_possible, reports, run_worker

SMALL_STAGING = dict(DDL_SHM_SLOT_BYTES="64K", DDL_SHM_MAX_BYTES="1M", DDL_SHM_SMALL_BYTES="1K")


def _check(results, min_checks=250, cma=None):
    """``cma``: whether the ranks must have used cross-memory copies (None: not checked)."""
    reps = reports(results)
    assert len({r["digest"] for r in reps}) == 1, "ranks got different bytes"
    assert all(r["checks"] >= min_checks for r in reps)
    assert {r["engine"] for r in reps} <= {"shm", "local"}
    if cma is not None and len(reps) > 1:
        assert {r["cma"] for r in reps} == {cma}, reps


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives_match_numpy(n):
    """The defaults (DDL_SHM_CMA=auto: cross-memory copies agreed wherever this machine
    allows them, and used by page size for the buffers of 8 MiB and more)."""
    _check(run_worker("collectives.py", n), 700, cma=n > 1 and cma_possible())


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_match_numpy_with_cross_memory_copies(n):
    """DDL_SHM_CMA=1: large private buffers read and written in place by the peers wherever
    this machine allows it, else staged."""
    _check(run_worker("collectives.py", n, env=dict(DDL_SHM_CMA="1")), 700, cma=cma_possible())


@pytest.mark.parametrize("cma", ["1", "0"])
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_through_a_tiny_staging_area(n, cma):
    """Messages many times the staging area go through the chunked pipeline; with
    DDL_SHM_CMA=0 every private buffer is staged through it."""
    _check(run_worker("collectives.py", n, env=dict(SMALL_STAGING, DDL_SHM_CMA=cma)), 700,
           cma=cma == "1" and cma_possible())


@pytest.mark.slow
def test_eight_ranks_oversubscribed():
    _check(run_worker("collectives.py", 8, "0,1,7,1000,65537,300001", timeout=600))


@pytest.mark.slow
def test_weak_memory_order_path():
    """The release/acquire counters used on POWER and aarch64, exercised here on x86."""
    _check(run_worker("collectives.py", 3, "0,3,1000,300001",
                      env=dict(SMALL_STAGING, DDL_SHM_FENCES="1")))


@pytest.mark.parametrize("policy", ["spin", "yield", "futex"])
def test_wait_policies(policy):
    _check(run_worker("collectives.py", 3, "0,5,70000", env=dict(DDL_SHM_WAIT=policy)))


def test_async_handles_complete_in_submission_order():
    for r in reports(run_worker("async_order.py", 3)):
        assert r["ok"]


def test_torch_tensors():
    pytest.importorskip("torch")
    for r in reports(run_worker("torch_tensors.py", 3)):
        assert r["failed"] == []


@pytest.mark.slow
def test_256_mib_allreduce():
    results = run_worker("big.py", 2, str(256 << 20), timeout=600)
    for r in reports(results):
        assert r["ok"], r


def test_cross_memory_only_when_every_rank_agrees():
    """One rank refusing cross-memory copies (DDL_SHM_CMA=0) makes every rank stage: a rank
    that read a peer in place while that peer staged nothing would wait for it forever."""
    per_rank = [{"DDL_SHM_CMA": "1"}, {"DDL_SHM_CMA": "0"}, {"DDL_SHM_CMA": "1"}]
    _check(run_worker("collectives.py", 3, "0,5,70000,300001", per_rank_env=per_rank), 200,
           cma=False)


def _check_auto(results, forced=()):
    """``forced``: ranks that read every buffer in place (DDL_SHM_CMA=1): no policy."""
    reps = reports(results)
    assert all(r["failed"] == [] for r in reps), reps
    assert len({r["digest"] for r in reps}) == 1, "ranks got different bytes"
    if not cma_possible():
        assert {r["cma"] for r in reps} == {False}
        return
    assert {r["cma"] for r in reps} == {True}
    for r in reps:
        if r["rank"] in forced:
            assert r["offered"] is None
        elif r["scannable"] and (r["collapsible"] or not r["torch_small"]):
            # numpy's arrays in place at once, torch's after their collapse (where its
            # memory is on small pages and this kernel collapses them)
            assert r["offered"] > 0, r
            assert r["collapses"] > 0 or not r["torch_small"], r


@pytest.mark.parametrize("n", [2, 3])
def test_large_private_buffers_by_page_size(n):
    """DDL_SHM_CMA=auto (the default): a buffer on huge pages is read in place by the
    peers, a reused torch tensor is collapsed into huge pages and then read in place, a
    fresh one is staged; every dtype, in place and out of place, bit for bit."""
    pytest.importorskip("torch")
    _check_auto(run_worker("cma_auto.py", n, timeout=300))


def test_large_private_buffers_with_ranks_that_choose_differently():
    """One rank reads every buffer in place (DDL_SHM_CMA=1), the others by page size: in
    one call some inputs are staged and some read in place."""
    pytest.importorskip("torch")
    per_rank = [{"DDL_SHM_CMA": "auto"}, {"DDL_SHM_CMA": "1"}, {}]
    _check_auto(run_worker("cma_auto.py", 3, per_rank_env=per_rank, timeout=300), forced=(1,))


@pytest.mark.parametrize("n,bound", [(2, 256 << 10), (3, 64 << 10)])
def test_one_step_bound_follows_the_ranks_on_the_host(n, bound):
    """DDL_SHM_SMALL_BYTES=auto (the default): two ranks on a host reduce up to 256 KiB in
    one step (both algorithms move the same bytes between them), more ranks up to 64 KiB.
    Sizes on both sides of either bound, every dtype, in and out of place: the same results
    as numpy, bit for bit on every rank."""
    res = run_worker("collectives.py", n, "16383,16385,32767,32769,65535,65537", timeout=300)
    _check(res, 300)
    assert {r["one_step"] for r in reports(res)} == {bound}


def test_ranks_with_another_one_step_bound_stop_at_start():
    """DDL_SHM_SMALL_BYTES decides whether a call takes one step or reduce-scatters: a
    rank with 4K against one with 64K stepped through a 16 KiB allreduce otherwise than
    its peer, took its result from steps that did not match, and the job failed later
    blaming another call (float32[70001] against float32[1000]). It is compared when the
    ranks attach."""
    per_rank = [{"DDL_SHM_SMALL_BYTES": "64K"}, {"DDL_SHM_SMALL_BYTES": "4K"}]
    res = run_worker("collectives.py", 2, "1000,4097,70001", per_rank_env=per_rank,
                     env=dict(DDL_INIT_TIMEOUT="10"), timeout=120)
    assert res[1].returncode == 1
    assert ("the ranks on this host differ in DDL_SHM_SMALL_BYTES: local rank 0 made "
            in res[1].stderr and "with 65536, this rank has 4096" in res[1].stderr), \
        res[1].stderr[-2000:]
    assert "DDLMismatchError" not in res[0].stderr + res[1].stderr
