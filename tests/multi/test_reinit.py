"""hvd.shutdown() then hvd.init() in a job whose ranks sit on several (simulated) hosts: the
multi-host engine, whose rendezvous on rank 0 goes with each shutdown and comes back on the
same port with each init. The ``shutdown`` and ``cycles`` parts of
tests/torch/workers/hvd_safety.py, judged as tests/torch/test_torch_safety.py judges them on
one host: a rank re-initialising before rank 0 has closed the last generation's rendezvous
must wait for the new one, never join the old one (and its stale keys)."""

import pytest

pytest.importorskip("torch")

from tests.core.util import hosts_env  # noqa: E402 - after the skip
from tests.torch.torch_util import reports, run_worker  # noqa: E402


@pytest.fixture(scope="module", params=[(4, 2), (3, 1)], ids=["2x2", "3x1"])
def job(request):
    n, per = request.param
    env = {"DDL_TIMEOUT": "20", "SAFETY_PARTS": "shutdown,cycles"}
    return n, reports(run_worker("hvd_safety.py", n, env=env, timeout=300,
                                 per_rank_env=hosts_env(n, per)))


@pytest.mark.timeout(360)
def test_shutdown_while_a_peer_is_in_a_collective_then_init_again(job):
    n, reps = job
    for rank, r in enumerate(reps):
        s = r["shutdown"]
        assert "error" not in s, s.get("error")
        for quitter in sorted({0, n - 1}):
            if rank != quitter:
                got = s[f"quit{quitter}_peer_error"]
                assert got["type"] == "DDLMismatchError", got
                assert f"rank {quitter}: hvd.shutdown()" in got["msg"], got
            assert s[f"quit{quitter}_in_step"], (rank, quitter)
            assert s[f"quit{quitter}_seconds"] < 20, s


@pytest.mark.timeout(360)
def test_twenty_shutdown_init_cycles_leak_nothing(job):
    _, reps = job
    for r in reps:
        c = r["cycles"]
        assert "error" not in c, c.get("error")
        # per cycle: the collectives were right, and (from the second shutdown on) threads,
        # file descriptors and this rank's /dev/shm segments are back where they were
        assert c["checked"] == [True] * 39, c["checked"]
        assert c["shm_left"] == []
