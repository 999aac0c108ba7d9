"""Horovod-level Average bit for bit Horovod's (sum, then one scale by postscale / size,
in float32 for 16-bit floats) on 3 ranks, where 1/3 is not a power of two: float16,
bfloat16, float32 and float64, numpy and torch, allreduce, grouped_allreduce,
reducescatter and the DistributedOptimizer's bucket allreduce, with and without
prescale/postscale (workers/hvd_average_bits.py); the joined-rank path is in
tests/torch/test_torch_join.py."""

from __future__ import annotations

import pytest

from .util import reports, run_worker

pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [3, 2])
def test_average_is_horovods_formula_bit_for_bit(n):
    for rank, r in enumerate(reports(run_worker("hvd_average_bits.py", n, timeout=280))):
        assert r["n"] == n
        if n == 3:
            assert r["old_formula_differs"] > 0  # the check can tell the two apart
        checks = {k: v for k, v in r.items() if k not in ("n", "old_formula_differs")}
        assert len(checks) == 4 * (4 * 2 * 5 + 2), len(checks)
        bad = {k: v for k, v in checks.items() if v}
        assert not bad, (rank, bad)
