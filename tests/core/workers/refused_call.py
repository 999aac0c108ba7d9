"""A core call refused on some ranks only, before its data moves (api._planned): every rank
raises (the refusing ones their own error, the others DDLMismatchError), and the job goes
on in step: each case is followed by checked calls. Before the fix the refusing rank raised
alone and its next call paired with the peers' pending one, silently (every later result
was the wrong partner's). Prints one JSON line."""

import json

import numpy as np
from outcome import record

import ddl

ddl.init()
R, N = ddl.rank(), ddl.size()
ODD = R == N - 1  # the rank that refuses
ONES = np.ones(16, np.float32)
CASES = {
    # an op the dtype does not allow, on one rank
    "int_average": lambda: ddl.allreduce(np.ones(16, np.int32 if ODD else np.float32),
                                         op=ddl.Average),
    # an out of the wrong size, on one rank
    "bad_out": lambda: ddl.allreduce(ONES, ddl.Sum, out=np.empty(15 if ODD else 16, np.float32)),
    # a root outside the job, on one rank
    "bad_root": lambda: ddl.broadcast(ONES, root_rank=N if ODD else 0),
    # a root that is no int, on one rank
    "root_type": lambda: ddl.broadcast(ONES, root_rank=None if ODD else 0),
    # a grouped call given a generator, with an op its dtype does not allow, on one rank
    "grouped": lambda: ddl.grouped_allreduce_(
        (np.ones(4, np.int32 if ODD else np.float32) for _ in range(2)), op=ddl.Average),
    # refused on every rank: each raises its own error, nobody a mismatch
    "everyone": lambda: ddl.allreduce(np.ones(16, np.int32), op=ddl.Average),
    # a 0-d tensor has no rows to gather, on one rank; the others gather
    "rows": lambda: ddl.allgather(np.float32(1) if ODD else np.ones((1, 2), np.float32)),
}
out = {"rank": R}
for name, call in CASES.items():
    before = ddl.allreduce_async(np.full(8, R + 1.0, np.float32), ddl.Sum)  # queued first
    record(out, name, call)
    after = [ddl.allreduce(np.full(16, float(i + R), np.float32), ddl.Sum) for i in range(3)]
    want = [i * N + N * (N - 1) / 2 for i in range(3)]
    out[f"{name}_after"] = (bool(np.all(before.wait() == N * (N + 1) / 2))
                            and all(bool(np.all(a == w)) for a, w in zip(after, want)))
print(json.dumps(out), flush=True)
ddl.shutdown()
