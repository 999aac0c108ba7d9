"""hvd.shutdown() then hvd.init() in a job whose ranks sit on several (simulated) hosts: the
multi-host engine, whose rendezvous on rank 0 goes with each shutdown and comes back on the
same port with each init. The ``shutdown`` and ``cycles`` parts of
tests/torch/workers/hvd_safety.py, judged as tests/torch/test_torch_safety.py judges them on
one host: a rank re-initialising before rank 0 has closed the last generation's rendezvous
must wait for the new one, never join the old one (and its stale keys)."""

import pytest

pytest.importorskip("torch")

from tests.core.util import hosts_env  # noqa: E402 - after the skip
from tests.torch.safety_checks import check_cycles, check_shutdown  # noqa: E402
from tests.torch.torch_util import reports, run_worker  # noqa: E402


@pytest.fixture(scope="module", params=[(4, 2), (3, 1)], ids=["2x2", "3x1"])
def job(request):
    n, per = request.param
    env = {"DDL_TIMEOUT": "20", "SAFETY_PARTS": "shutdown,cycles"}
    return n, reports(run_worker("hvd_safety.py", n, env=env, timeout=300,
                                 per_rank_env=hosts_env(n, per)))


@pytest.mark.timeout(360)
def test_shutdown_while_a_peer_is_in_a_collective_then_init_again(job):
    check_shutdown(*job)


@pytest.mark.timeout(360)
def test_twenty_shutdown_init_cycles_leak_nothing(job):
    check_cycles(job[1])
