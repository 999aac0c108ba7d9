"""Sub-groups on the ddl backend vs gloo: the two disjoint pairs of a 4-rank job allreduce at
the same time, once on `new_group(..., backend="ddl")` and once on gloo groups.

    ddlrun -n 4 python benchmarks/subgroup_allreduce.py
"""

import statistics
import time

import torch
import torch.distributed as dist

import ddl.torch  # noqa: F401  registers the "ddl" backend

SIZES = (1 << 16, 1 << 20, 1 << 22)  # float32 elements: 256 KiB, 4 MiB, 16 MiB

torch.set_num_threads(1)
dist.init_process_group("ddl", init_method="env://")
R, N = dist.get_rank(), dist.get_world_size()
if N != 4:
    raise SystemExit("run with 4 ranks: ddlrun -n 4 ...")
pairs = {}
for backend in ("ddl", "gloo"):
    lo = dist.new_group([0, 1], backend=backend)
    hi = dist.new_group([2, 3], backend=backend)
    pairs[backend] = lo if R < 2 else hi
res: dict[tuple[int, str], list[float]] = {}
for size in SIZES:
    x = torch.ones(size)
    for _ in range(3):  # rounds, the backends interleaved
        for backend, g in pairs.items():
            dist.barrier()
            out = []
            for _ in range(10):
                t = time.perf_counter()
                dist.all_reduce(x, group=g)
                out.append(time.perf_counter() - t)
            res.setdefault((size, backend), []).append(statistics.median(out))
if R == 0:
    for size in SIZES:
        d, g = (statistics.median(res[(size, b)]) for b in ("ddl", "gloo"))
        print(f"{size * 4 / 2**20:6.2f} MiB  ddl {d * 1e3:7.3f} ms  gloo {g * 1e3:7.3f} ms  "
              f"gloo/ddl {g / d:5.2f}x")
dist.destroy_process_group()
