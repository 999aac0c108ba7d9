"""Where the shared-memory engine's one-step allreduce should give way to reduce-scatter +
allgather (``DDL_SHM_SMALL_BYTES``), side by side in one job: one engine per bound on every
rank, calls interleaved, float32 sums in place and out of place on numpy arrays and in
place on a ``ddl.malloc`` array (read in place by reduce-scatter + allgather, staged by the
one step). Median microseconds per call over ``reps`` timings of ``calls`` back-to-back
calls, each timing after a barrier; ratios: the first bound's time over each other's.

    ddlrun -n 2 python benchmarks/shm_one_step.py [KiB,...] [bounds] [reps] [calls]

``bounds``: comma-separated DDL_SHM_SMALL_BYTES values (default ``64K,auto``).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from ddl import config, dtypes
from ddl.engines.shm import ShmEngine
from ddl.ops import ReduceOp

F32 = dtypes.BY_NAME["float32"]
sizes = [int(s) for s in
         (sys.argv[1] if len(sys.argv) > 1 else "64,128,192,256,384,512").split(",")]
bounds = (sys.argv[2] if len(sys.argv) > 2 else "64K,auto").split(",")
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 9
calls = int(sys.argv[4]) if len(sys.argv) > 4 else 20
rank, n = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
common = dict(job_id=os.environ["DDL_JOB_ID"], host_index=0, local_rank=rank, local_size=n,
              global_rank=int(os.environ["RANK"]), heap_bytes=64 << 20, wait_policy="auto")
engines = [ShmEngine(scope=f"s{i}", small_bytes=config.get("DDL_SHM_SMALL_BYTES", {
    "DDL_SHM_SMALL_BYTES": b}), **common) for i, b in enumerate(bounds)]
kinds = ("in", "out", "heap")
if rank == 0:
    print(f"# {n} ranks, median us of {reps} interleaved timings of {calls} calls each "
          "(float32 sum); bounds " + ", ".join(f"{b} = {e.small_bytes} B"
                                               for b, e in zip(bounds, engines)))
    print(f"# {'KiB':>5} " + " ".join(f"{k + ' ' + b:>11}" for k in kinds for b in bounds)
          + "".join(f"  {k} {bounds[0]}/{b}" for k in kinds for b in bounds[1:]))
for kib in sizes:
    count = (kib << 10) // 4
    src = [np.ones(count, np.float32) for _ in engines]
    out = [np.empty(count, np.float32) for _ in engines]
    heap = [e.heap.malloc((count,), np.float32) for e in engines]
    times: dict[tuple[str, int], list[float]] = {(k, j): [] for k in kinds
                                                 for j in range(len(engines))}
    for i in range(reps + 2):
        for k in kinds:
            for j, eng in enumerate(engines):
                a = heap[j] if k == "heap" else src[j]
                b = out[j] if k == "out" else a
                a[:] = 1  # keep values finite
                eng.barrier()
                t = time.perf_counter()
                for _ in range(calls):
                    eng.allreduce(a, b, F32, ReduceOp.SUM, (count,))
                if i >= 2:
                    times[k, j].append((time.perf_counter() - t) / calls)
    med = {c: 1e6 * float(np.median(v)) for c, v in times.items()}
    if rank == 0:
        print(f"  {kib:5d} " + " ".join(f"{med[k, j]:11.1f}" for k in kinds
                                        for j in range(len(engines)))
              + "".join(f"  {med[k, 0] / med[k, j]:9.2f}x" for k in kinds
                        for j in range(1, len(engines))), flush=True)
    del heap
for eng in engines:
    eng.close()
