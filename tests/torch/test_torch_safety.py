"""Ranks out of step never give a wrong result (2 and 3 real processes): every Horovod-level
call is one negotiated call, a failure on one rank raises on every rank, the job goes on
after a mismatch, and shutdown()/init() cycle. See workers/hvd_safety.py for each part; one
job per rank count, the tests read its report. The soak test mixes 1,000 random calls with
errors injected on single ranks."""

import pytest
from safety_checks import check_cycles, check_shutdown
from torch_util import reports, run_worker

from tests.core.util import hosts_env

FAST = 10.0  # seconds: an error on every rank at once, not after DDL_TIMEOUT (20 s) ran out
# "2x2": 4 ranks, 2 per (simulated) host: the multi-host engine, whose call identities ride
# on each call's first message across hosts (engines/identity_round.py). Its shutdown/init
# parts are tests/multi/test_reinit.py's.


@pytest.fixture(scope="module", params=[2, 3, "2x2"])
def job(request):
    if request.param == "2x2":
        env = {"DDL_TIMEOUT": "20", "SAFETY_PARTS": "grouped_grad,failures,out_of_step,names"}
        return 4, reports(run_worker("hvd_safety.py", 4, env=env, timeout=300,
                                     per_rank_env=hosts_env(4, 2, DDL_OPTIONS="-mode r:2x2")))
    n = request.param
    return n, reports(run_worker("hvd_safety.py", n, env={"DDL_TIMEOUT": "20"}, timeout=240))


def _single_host(reps, part):
    if part not in reps[0]:
        pytest.skip(f"the {part} part across hosts runs in tests/multi/test_reinit.py")


@pytest.mark.timeout(300)
def test_grouped_allreduce_is_differentiable(job):
    n, reps = job
    for r in reps:
        g = r["grouped_grad"]
        assert "error" not in g, g.get("error")
        assert g["values"] and g["requires_grad"] and g["inplace"] and g["in_step"], g
        assert g["grad_sum"] == [n, 2 * n]  # the grouped allreduce (Sum) of the gradients
        assert g["grad_per_output"] == [n] * 3
        assert g["grad_average"] == [1.0, 1.0]
        assert g["allreduce_grad"] == n


LOCAL = ["bool_average", "bad_root", "bad_splits", "compression", "not_a_tensor",
         "async_bad_op"]
# optimizer_sparse: one rank's gradient sparse, the others' dense: a sparse allreduce
# against a dense one, which the exchange reports on every rank
# (two names on two ranks are no error: named calls are matched by name, test_torch_named)
AGREED = ["dtype", "grouped_layout", "grouped_allgather_layout", "model",
          "optimizer_sparse"]
OWN_ERROR = {"bool_average": "DDLConfigError", "bad_root": "DDLConfigError",
             "bad_splits": "DDLConfigError", "compression": "RuntimeError",
             "not_a_tensor": "AttributeError", "async_bad_op": "DDLConfigError"}


@pytest.mark.timeout(300)
def test_a_failure_on_one_rank_raises_on_every_rank_at_once(job):
    n, reps = job
    victim = n - 1
    for rank, r in enumerate(reps):
        f = r["failures"]
        assert "error" not in f, f.get("error")
        for case in LOCAL + AGREED:
            got = f[case]
            assert got is not None, (rank, case, "did not raise")
            assert got["seconds"] < FAST, (rank, case, got)
            assert f[f"{case}_in_step"], (rank, case)  # and the job goes on
        for case in LOCAL:
            got = f[case]
            if rank == victim:  # its own error
                assert got["type"] == OWN_ERROR[case], (case, got)
            else:  # names the rank that failed and what it failed with
                assert got["type"] == "DDLMismatchError", (rank, case, got)
                assert f"rank {victim}: hvd." in got["msg"] and "failed here" in got["msg"], got
        for case in AGREED:
            assert f[case]["type"] == "DDLMismatchError", (rank, case, f[case])
        assert "Average is not defined for bool" in f["bool_average"]["msg"]
        assert f"root_rank {n} is outside" in f["bad_root"]["msg"]
        assert f"rank {victim}: hvd.grouped_allreduce(3 tensors" in f["grouped_layout"]["msg"]
        assert "broadcast_parameters(2 tensors: float32[4]" in f["model"]["msg"]


@pytest.mark.timeout(300)
def test_calls_out_of_step_raise_then_every_result_is_right(job):
    n, reps = job
    victim = n - 1
    for rank, r in enumerate(reps):
        o = r["out_of_step"]
        assert "error" not in o, o.get("error")
        for case in ("raised_before", "mismatch"):
            assert o[case] is not None and o[case]["seconds"] < FAST, (rank, case, o[case])
        dup = o["duplicate_one_rank"]
        if rank == victim:  # a local ValueError, as in Horovod; the others never heard of it
            assert dup["type"] == "DDLConfigError" and "Duplicate name 'left'" in dup["msg"]
            assert dup["value_error"] and dup["seconds"] < FAST
        else:
            assert dup is None
        assert o["left_over"] is None  # the async broadcast left over still completes
        assert o["checked"] == [True] * 20, o["checked"]


@pytest.mark.timeout(300)
def test_duplicate_names_raise_value_error_on_every_rank_as_in_horovod(job):
    n, reps = job
    for r in reps:
        d = r["names"]
        assert "error" not in d, d.get("error")
        for kind in ("allreduce", "allgather", "broadcast"):
            got = d[kind]
            # Horovod's tests: the second in-flight use raises ValueError at once
            assert got is not None and got["value_error"] and got["at"] == 0, (kind, got)
            assert "Duplicate name 'duplicate_name'" in got["msg"]
            assert d[f"{kind}_in_step"]
        assert d["reuse_after_synchronize"]


@pytest.mark.timeout(300)
def test_shutdown_while_a_peer_is_in_a_collective_then_init_again(job):
    n, reps = job
    _single_host(reps, "shutdown")
    check_shutdown(n, reps)


@pytest.mark.timeout(300)
def test_twenty_shutdown_init_cycles_leak_nothing(job):
    _, reps = job
    _single_host(reps, "cycles")
    check_cycles(reps)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_random_collectives_with_injected_errors_on_3_ranks():
    reps = reports(run_worker("hvd_soak.py", 3, "1000", env={"DDL_TIMEOUT": "20"},
                              timeout=240))
    for r in reps:
        assert r["calls"] == 1000, r
        assert r["wrong"] == [], r["wrong"][:5]
        assert r["unexpected"] == [], r["unexpected"][:5]
        assert r["injected"] > 50 and r["raised"] >= r["injected"], r
    # the same calls failed on every rank
    assert len({tuple(r["failed_at"]) for r in reps}) == 1
