"""hvd.sparse_allreduce_async against the dense sum/average, and its agreed errors."""

import json
import sys

import torch

import ddl.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
failed, ran = [], []


def sparse(r):
    idx = torch.tensor([[r % 4, 3], [0, r % 2]])  # rows, cols; rank-dependent pattern
    vals = torch.tensor([float(r + 1), 2.0])
    return torch.sparse_coo_tensor(idx, vals, (4, 2))


dense_sum = sum(sparse(r).to_dense() for r in range(N))
for op, want in ((hvd.Sum, dense_sum), (hvd.Average, dense_sum / N)):
    h = hvd.sparse_allreduce_async(sparse(R), name=f"emb.{op.name}", op=op)
    out = hvd.synchronize(h)
    ran.append(op.name)
    if not out.is_sparse or not torch.equal(out.to_dense(), want):
        failed.append(f"{op.name}: {out.to_dense().tolist()} != {want.tolist()}")
try:
    # async: the peers' error arrives when they synchronize, as Horovod's
    hvd.synchronize(hvd.sparse_allreduce_async(sparse(R), op=hvd.Max if R == 0 else hvd.Sum))
    failed.append("Max on one rank: no error")
except (hvd.DDLConfigError, hvd.DDLMismatchError) as exc:
    ran.append(f"error:{type(exc).__name__}")
after = hvd.synchronize(hvd.sparse_allreduce_async(sparse(R), op=hvd.Sum))
if not torch.equal(after.to_dense(), dense_sum):
    failed.append("after error: wrong")
ran.append("after")
print(json.dumps({"rank": R, "ran": ran, "failed": failed}))
hvd.shutdown()
sys.exit(0)
