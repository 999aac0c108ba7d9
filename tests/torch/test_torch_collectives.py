"""Horovod's integer Average, integer scale factors, reducescatter and the gradients of
every collective, on 2 and 3 real ranks, against numpy references (workers/hvd_collectives.py)."""

import pytest
from torch_util import reports, run_worker


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_match_horovod_on_every_rank(n):
    for r in reports(run_worker("hvd_collectives.py", n)):
        assert r["failed"] == [], r
