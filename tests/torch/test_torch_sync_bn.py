"""hvd.SyncBatchNorm equals one BatchNorm over the whole batch (2 and 3 ranks with unequal
per-rank batches; 2-d and 4-d inputs; momentum and cumulative averages; eval mode)."""

from __future__ import annotations

import pytest
from torch_util import reports, run_worker


@pytest.mark.parametrize("n", [2, 3])
def test_sync_batch_norm_matches_the_global_batch(n):
    for rep in reports(run_worker("hvd_sync_bn.py", n)):
        assert len(rep["ran"]) == 56, rep["ran"]
        assert rep["failed"] == [], rep["failed"]
