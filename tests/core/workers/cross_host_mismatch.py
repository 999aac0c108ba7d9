"""Core calls that differ between hosts: each must raise DDLMismatchError on every rank (not
pair silently, not abort in Gloo), and the job goes on: a right allreduce after each.
The ranks of host 0 call one thing, those of the other hosts another. Prints one JSON line."""

import json
import os

import numpy as np
from outcome import record

import ddl

ddl.init()
R, N = ddl.rank(), ddl.size()
HOST = int(os.environ["DDL_HOST_INDEX"])
S = ddl.Sum  # (Average refuses int32 on that rank alone, before any exchange)
CASES = {
    "dtype": lambda: ddl.allreduce(np.ones(256, np.float32 if HOST == 0 else np.int32), S),
    "numel": lambda: ddl.allreduce(np.ones(256 + 64 * HOST, np.float32), S),
    "op": lambda: ddl.allreduce(np.ones(16, np.float32), op=ddl.Sum if HOST == 0 else ddl.Max),
    "numel_large": lambda: ddl.allreduce(np.ones(300_000 + 64 * HOST, np.float32), S),
    "dtype_large": lambda: ddl.allreduce(np.ones(300_000, np.float32 if HOST == 0
                                                 else np.int32), S),
    "kind": lambda: (ddl.allreduce(np.ones(8, np.float32), S) if HOST == 0
                     else ddl.broadcast(np.ones(8, np.float32), root_rank=0)),
    "root": lambda: ddl.broadcast(np.ones(8, np.float32), root_rank=HOST),
    "rows": lambda: ddl.allgather(np.ones((2, 3 + HOST), np.float32)),
    "reduce_scatter": lambda: ddl.reduce_scatter(np.ones((N * 4 + HOST, 2), np.float32), S),
}
# how many rows the identity round gathers: one per host where the grid allows it
out = {"rank": R, "round_rows": ddl.api._s().engine._round.line.size}
for name, call in CASES.items():
    record(out, name, call)
    after = ddl.allreduce(np.full(1000, R + 1.0, np.float32), S)
    out[f"{name}_after"] = bool(np.all(after == N * (N + 1) / 2))
print(json.dumps(out), flush=True)
ddl.shutdown()
