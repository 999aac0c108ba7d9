"""hvd.allreduce's per-signature plan cache (issue 13): what a call computes depends on
every argument, cached or not, on one rank (no exchange at all) and on two (folded)."""

from __future__ import annotations

import pytest

from .util import reports, run_worker


@pytest.mark.parametrize("n", [1, 2])
def test_each_signature_gets_its_own_plan(n):
    for rank, r in enumerate(reports(run_worker("hvd_plan_cache.py", n, timeout=120))):
        avg_f = sum(3.0 + k for k in range(n)) / n
        avg_i = sum(3 + k for k in range(n)) // n
        total = sum(3.0 + k for k in range(n))
        want = [avg_f, avg_i, total, 2 * total, 0.5 * total, 3.0 + n - 1, "int64",
                [True, float(n)], [False, float(n) * n, float(n)]]
        assert r["seen"] == [want] * 3, (rank, r["seen"])
        assert r["errors"] == ["DDLConfigError"] * 2  # a bad op fails every time
        assert r["plans"] == 8  # one plan per signature (the bad op is never cached)
        if n == 1:
            assert r["separate"] == 0  # one rank: nobody to agree with, no exchange step
