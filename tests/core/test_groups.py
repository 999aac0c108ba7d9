"""ddl.new_group on one host: shared-memory groups beside the job's own engine."""

import pytest

from .util import reports, run_worker


def check_groups(reps, n):
    by_rank = {r["rank"]: r for r in reps}
    assert all(r["checks"] > 50 for r in reps)
    for name in ("lo", "hi", "reversed", "world", "across", "lo_again"):
        members = [r for r in reps if name in r["digests"]]
        assert members, name
        assert len({r["digests"][name] for r in members}) == 1, f"{name}: ranks differ"
    assert all(r["engines"]["self"] == "local" for r in reps)
    return by_rank


@pytest.mark.parametrize("n", [2, 3, 4])
def test_groups_on_one_host(n):
    reps = reports(run_worker("groups.py", n))
    by_rank = check_groups(reps, n)
    # a strict subset gets shared memory of its own; the whole job in order shares the job's
    assert by_rank[0]["engines"]["lo_again"] == ("local" if n < 4 else "shm")
    assert by_rank[0]["engines"]["world"] == "shm"
    assert by_rank[0]["engines"]["across"] == "shm"


def test_groups_across_simulated_hosts():
    """2 "hosts" x 2 ranks (each rank told its host): a group inside a host runs on
    shared memory, one across hosts on the job's network transport (Gloo here; MPI in
    tests/multi/test_mpi_engine.py)."""
    pytest.importorskip("torch")
    n, per = 4, 2
    pre = [dict(LOCAL_WORLD_SIZE=str(per), LOCAL_RANK=str(r % per), DDL_HOST_INDEX=str(r // per),
                GROUP_RANK=str(r // per)) for r in range(n)]
    reps = reports(run_worker("groups.py", n, per_rank_env=pre, timeout=400))
    check_groups_across_hosts(reps, "ddl/gloo")


def check_groups_across_hosts(reps, network):
    by_rank = check_groups(reps, len(reps))
    assert by_rank[0]["engines"]["lo"] == "shm"  # ranks 0 and 1 share host 0
    assert by_rank[2]["engines"]["hi"] == "shm"
    assert by_rank[0]["engines"]["across"] == network  # ranks 0 and 3: two hosts
    assert by_rank[0]["engines"]["world"] == network
