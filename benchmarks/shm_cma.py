"""Private buffers on the shared-memory engine: read in place by cross-memory copies
(DDL_SHM_CMA=1) against staged through the slots (DDL_SHM_CMA=0), side by side in one job:
two engines per rank, calls interleaved. Shared-heap buffers (ddl.malloc) for reference.

    ddlrun -n 2 python benchmarks/shm_cma.py [MiB,...] [reps]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from ddl import dtypes
from ddl.engines.shm import ShmEngine
from ddl.ops import ReduceOp

F32 = dtypes.BY_NAME["float32"]
sizes = [float(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "1,4,16,42").split(",")]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 15
rank, n = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
common = dict(job_id=os.environ["DDL_JOB_ID"], host_index=0, local_rank=rank, local_size=n,
              global_rank=int(os.environ["RANK"]), heap_bytes=64 << 20, wait_policy="auto")
engines = {"cma": ShmEngine(scope="bcma", cma=True, **common),
           "staged": ShmEngine(scope="bstg", cma=False, **common)}
engines["heap"] = engines["staged"]
engines["cma"].block_bytes = int(os.environ.get("CMA_BLOCK", 256 << 10))
assert engines["cma"].cross_memory, "cross-memory copies are not allowed on this machine"
if rank == 0:
    print(f"# {n} ranks, median ms of {reps} interleaved calls (allreduce in place, float32)")
    print(f"# {'MiB':>6} {'cma':>8} {'staged':>8} {'heap':>8} {'staged/cma':>11}")
for mib in sizes:
    count = int(mib * (1 << 20)) // 4
    bufs = {"cma": np.ones(count, np.float32), "staged": np.ones(count, np.float32)}
    bufs["heap"] = engines["heap"].heap.malloc((count,), np.float32)
    bufs["heap"][:] = 1
    times: dict[str, list[float]] = {k: [] for k in bufs}
    for i in range(reps + 2):
        for k, eng in engines.items():
            eng.barrier()
            t = time.perf_counter()
            eng.allreduce(bufs[k], bufs[k], F32, ReduceOp.SUM, (count,))
            if i >= 2:
                times[k].append(time.perf_counter() - t)
            bufs[k][:1] = 1  # keep values finite
    med = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    if rank == 0:
        print(f"  {mib:6g} {med['cma']:8.2f} {med['staged']:8.2f} {med['heap']:8.2f} "
              f"{med['staged'] / med['cma']:10.2f}x", flush=True)
for eng in (engines["cma"], engines["staged"]):
    eng.close()
