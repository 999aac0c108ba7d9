"""hvd.sparse_allreduce_async (Horovod's sparse allreduce: allgather of indices and
values) on 2 and 3 ranks; an op one rank rejects raises on every rank. The
DistributedOptimizer reduces sparse gradients the same way when sparse_as_dense is off."""

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


@pytest.mark.parametrize("n", [2, 3])
def test_distributed_optimizer_reduces_sparse_gradients_as_horovod(n):
    reps = reports(run_worker("hvd_sparse_optimizer.py", n))
    for rep in reps:
        # one bucket (embedding and linear layer): the embedding allgathered, the rest packed
        assert rep["modes"] == ["sparse"] and rep["grad_sparse"] is True, rep
        assert rep["dense_modes"] != ["sparse"], rep  # sparse_as_dense: reduced dense
        assert rep["same"] is True  # bitwise the same weights on every rank
        assert rep["vs_reference"] is True  # one process on the concatenated batch
        assert rep["vs_sparse_as_dense"] is True and rep["predivide"] is True
        assert rep["trained"] is True
        # torch.optim.SparseAdam (sparse gradients only) steps on the allgathered gradient
        assert rep["adam_modes"] == ["sparse"] and rep["adam_grad_sparse"] is True, rep
        assert rep["adam_same"] is True and rep["adam_trained"] is True, rep
        assert rep["adam_vs_reference"] is True, rep  # the concatenated batch, one process
        # sparse_as_dense: reduced dense, handed back sparse (SparseAdam takes nothing else)
        assert rep["dense_grad_sparse"] is True and rep["adam_dense_grad_sparse"] is True, rep
        assert rep["adam_dense_vs_reference"] is True, rep
