"""Async handles: many in flight, waited in any order, mixed with blocking calls."""

import json

import numpy as np

import ddl

ddl.init()
R, N = ddl.rank(), ddl.size()
bufs = [np.full(1000 * (i + 1) + 3, R + i, np.float64) for i in range(12)]
handles = [ddl.allreduce_async(b, op=ddl.Sum, name=f"g{i}") for i, b in enumerate(bufs)]
inplace = np.full(70_000, R, np.int32)
h_in = ddl.allreduce_async_(inplace, op=ddl.Max)
mid = ddl.allreduce(np.full(3, R + 1, np.int64), op=ddl.Sum)  # blocking, queued behind
g = ddl.allgather_async(np.full((R + 1, 2), R, np.int16))
b = ddl.broadcast_async(np.full(9, R, np.float32), root_rank=N - 1)
ok = True
for i in reversed(range(len(bufs))):
    res = ddl.synchronize(handles[i])
    ok &= bool(np.all(res == sum(R2 + i for R2 in range(N))))
    ok &= bool(np.all(bufs[i] == R + i))  # out-of-place: input untouched
assert ddl.synchronize(h_in) is inplace
ok &= bool(np.all(inplace == N - 1))
ok &= int(mid[0]) == N * (N + 1) // 2
ok &= ddl.synchronize(g).shape == (N * (N + 1) // 2, 2)
ok &= bool(np.all(ddl.synchronize(b) == N - 1))
ok &= all(ddl.poll(h) for h in handles)
print(json.dumps({"rank": R, "ok": ok}))
ddl.shutdown()
