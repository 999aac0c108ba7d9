"""Where a buffer's memory came from, against the cross-memory path: ``ddl.allreduce_`` in
place on 10.5 M float32 (42 MB) held by a numpy array, a tensor torch allocated, numpy
memory wrapped by ``torch.from_numpy``, and a ``ddl.malloc`` array (the heap). Median ms of
10 calls after 2 warm-ups, interleaved. Run with ``DDL_SHM_CMA=1`` (every buffer read in
place), ``=0`` (every buffer staged) and without (``auto``: by page size):

    DDL_SHM_CMA=1 ddlrun -n 2 python benchmarks/shm_cma_buffers.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

import ddl
from ddl import api

torch.set_num_threads(1)
ddl.init()
P = 10_500_000
cases = {"numpy": np.ones(P, np.float32), "torch": torch.ones(P),
         "numpy-as-torch": torch.from_numpy(np.ones(P, np.float32)),
         "heap": ddl.malloc((P,), np.float32)}
cases["heap"][:] = 1
times: dict[str, list[float]] = {k: [] for k in cases}
for i in range(12):
    for k, x in cases.items():
        ddl.barrier()
        t = time.perf_counter()
        ddl.allreduce_(x, ddl.Sum)
        if i >= 2:
            times[k].append(time.perf_counter() - t)
        x[:1] = 1  # keep values finite
if ddl.rank() == 0:
    cma = api.session().engine.cross_memory
    print(f"cross-memory {cma}:",
          ", ".join(f"{k} {1e3 * float(np.median(v)):.2f} ms" for k, v in times.items()))
ddl.shutdown()
