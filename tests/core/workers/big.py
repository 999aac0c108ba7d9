"""A 256 MiB allreduce (private buffers and ddl.malloc buffers) checked exactly."""

import json
import sys

import numpy as np

import ddl

ddl.init()
R, N = ddl.rank(), ddl.size()
count = int(sys.argv[1]) // 4
x = np.empty(count, np.float32)
x[:] = (np.arange(count) % 251).astype(np.float32) + R
want = (np.arange(count) % 251).astype(np.float32) * N + N * (N - 1) // 2
ddl.allreduce_(x, op=ddl.Sum)
ok = bool(np.array_equal(x, want))
del x
h = ddl.malloc((count,), np.float32)
h[:] = (np.arange(count) % 251).astype(np.float32) + R
ddl.allreduce_(h, op=ddl.Sum)
ok_heap = bool(np.array_equal(h, want))
print(json.dumps({"rank": R, "ok": ok and ok_heap, "private": ok, "heap": ok_heap}))
ddl.shutdown()
