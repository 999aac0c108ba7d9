"""hvd.sparse_allreduce_async (Horovod's sparse allreduce: allgather of indices and
values) on 2 and 3 ranks; an op one rank rejects raises on every rank."""

from __future__ import annotations

import pytest
from torch_util import reports, run_worker


@pytest.mark.parametrize("n", [2, 3])
def test_sparse_allreduce(n):
    reps = reports(run_worker("hvd_sparse.py", n))
    for rep in reps:
        assert rep["failed"] == [], rep["failed"]
        assert rep["ran"][:2] == ["SUM", "AVERAGE"] and rep["ran"][-1] == "after"
    assert reps[0]["ran"][2] == "error:DDLConfigError"  # its own error
    assert all(r["ran"][2] == "error:DDLMismatchError" for r in reps[1:])  # told of it
