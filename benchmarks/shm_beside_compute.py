"""A 42 MB allreduce of a torch tensor against the same bytes in ddl's shared heap, while
the ranks do other things: wait for it, sleep, or compute (``torch.mm`` in a loop, as
backward does beside DDP's bucket allreduces), with rank 0 issuing on time or late.

    ddlrun -n 2 python benchmarks/shm_beside_compute.py

Prints, per buffer and case, the median time from the later rank's issue to completion
(ms; the collective runs on ddl's worker through the ``ddl`` torch.distributed backend).
Staged buffers synchronise once per 4 MiB chunk, heap buffers twice per call: on busy
cores each synchronisation waits for the peer's thread to be scheduled
(docs/performance.md, "DDP's buckets in the shared heap").
"""

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import ddl
import ddl.torch  # noqa: F401 - registers the "ddl" backend

torch.set_num_threads(1)
dist.init_process_group("ddl", init_method="env://")
N_ELEMS = 10_500_000
buffers = {"torch tensor (staged)": torch.ones(N_ELEMS),
           "heap (ddl.malloc)": torch.from_numpy(ddl.malloc((N_ELEMS,), np.float32))}
weights, rows = torch.ones(2048, 2048), torch.ones(32, 2048)


def compute(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        torch.mm(rows, weights)


def once(buf: torch.Tensor, late_ms: float, meanwhile: str) -> float:
    buf.fill_(1.0)
    ddl.barrier()
    t0 = time.perf_counter()
    if ddl.rank() == 0:
        compute(late_ms)
    done: list[float] = []
    work = dist.all_reduce(buf, async_op=True)
    marked = work.get_future().then(lambda _: done.append(time.perf_counter()))
    if meanwhile == "compute":
        compute(30)
    elif meanwhile == "sleep":
        time.sleep(0.03)
    work.wait()
    marked.wait()
    return (done[0] - t0) * 1e3 - late_ms


for late in (0, 10):
    for meanwhile in ("wait", "sleep", "compute"):
        for label, buf in buffers.items():
            ms = statistics.median(once(buf, late, meanwhile) for _ in range(9))
            if ddl.rank() == 0:
                print(f"rank 0 late by {late:2d} ms, ranks {meanwhile:7s} meanwhile, "
                      f"{label:22s} {ms:6.2f} ms", flush=True)
dist.destroy_process_group()
