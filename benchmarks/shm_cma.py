"""Private buffers on the shared-memory engine, by the three settings of DDL_SHM_CMA, side by
side in one job: ``auto`` (peers read and write a buffer in place when its pages are huge,
engines/hugepages.py), ``1`` (every buffer of 8 MiB and more in place), ``0`` (every buffer
staged through the slots); on a numpy array and on a tensor torch allocated (4 KiB pages
until ``auto`` collapses them), and a ``ddl.malloc`` array (the heap) for reference. One
engine per setting on every rank, calls interleaved, in-place float32 allreduce, median ms
per call. ``calls``: back-to-back calls per timing (as ddl-perf's timed loop makes them;
default 1, every timing after a barrier).

    ddlrun -n 2 python benchmarks/shm_cma.py [MiB,...] [reps] [calls]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

from ddl import dtypes
from ddl.engines.shm import ShmEngine
from ddl.ops import ReduceOp

F32 = dtypes.BY_NAME["float32"]
SETTINGS = {"auto": "auto", "1": True, "0": False}
sizes = [float(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "8,16,64").split(",")]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 15
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 1
rank, n = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
common = dict(job_id=os.environ["DDL_JOB_ID"], host_index=0, local_rank=rank, local_size=n,
              global_rank=int(os.environ["RANK"]), heap_bytes=128 << 20, wait_policy="auto")
engines = {k: ShmEngine(scope=f"b{i}", cma=v, **common)
           for i, (k, v) in enumerate(SETTINGS.items())}
assert engines["1"].cross_memory, "cross-memory copies are not allowed on this machine"
cases = [(k, kind) for kind in ("numpy", "torch") for k in SETTINGS] + [("0", "heap")]
if rank == 0:
    print(f"# {n} ranks, median ms of {reps} interleaved timings of {calls} call(s) each "
          "(allreduce in place, float32)")
    print(f"# {'MiB':>5} " + " ".join(f"{kind + ' ' + k:>11}" for k, kind in cases)
          + "   0/auto numpy  0/auto torch")
for mib in sizes:
    count = int(mib * (1 << 20)) // 4
    bufs = {}
    for k, kind in cases:
        if kind == "numpy":
            bufs[k, kind] = np.ones(count, np.float32)
        elif kind == "torch":
            bufs[k, kind] = torch.ones(count).numpy()  # torch's allocator, viewed by numpy
        else:
            bufs[k, kind] = engines[k].heap.malloc((count,), np.float32)
            bufs[k, kind][:] = 1
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    for i in range(reps + 2):
        for k, kind in cases:
            eng, buf = engines[k], bufs[k, kind]
            eng.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                eng.allreduce(buf, buf, F32, ReduceOp.SUM, (count,))
            if i >= 2:
                times[k, kind].append((time.perf_counter() - t) / calls)
            buf[:] = 1  # keep values finite
    med = {c: 1e3 * float(np.median(v)) for c, v in times.items()}
    if rank == 0:
        print(f"  {mib:5g} " + " ".join(f"{med[c]:11.2f}" for c in cases)
              + f"   {med['0', 'numpy'] / med['auto', 'numpy']:11.2f}x"
              f"  {med['0', 'torch'] / med['auto', 'torch']:11.2f}x", flush=True)
    del bufs
for eng in engines.values():
    eng.close()
