"""The cost of a name: a blocking 1 KiB hvd.allreduce (float32[256]), unnamed and named,
side by side in one job (rounds alternate, so both see the same noise), and named calls
issued in a different order on each rank (the pool: ddl/hvd/named.py).

    .venv/bin/ddlrun -n 2 .venv/bin/python benchmarks/named_calls.py [ROUNDS] [CALLS]

Rank 0 prints the median microseconds per call of each kind over ROUNDS rounds of CALLS
calls. Run it with PYTHONPATH=<another checkout>/ddl-core to measure that tree."""

import statistics
import sys
import time

import torch

import ddl.torch as hvd

torch.set_num_threads(1)
hvd.init()
R = hvd.rank()
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 500
t = torch.ones(256)


def unnamed() -> None:
    hvd.allreduce(t, op=hvd.Sum)


def named() -> None:
    hvd.allreduce(t, op=hvd.Sum, name="grad.w")


def crossed() -> None:
    # two async named calls, submitted in opposite orders on even and odd ranks
    names = ("grad.a", "grad.b") if R % 2 == 0 else ("grad.b", "grad.a")
    hs = [hvd.allreduce_async(t, op=hvd.Sum, name=n) for n in names]
    for h in hs:
        hvd.synchronize(h)


kinds = {"unnamed": unnamed, "named": named}
if "crossed" in sys.argv[3:] or len(sys.argv) <= 3:
    kinds["crossed (2 calls)"] = crossed
times: dict[str, list[float]] = {k: [] for k in kinds}
for fn in kinds.values():  # warm up
    for _ in range(50):
        fn()
for _ in range(ROUNDS):
    for kind, fn in kinds.items():
        hvd.barrier()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times[kind].append((time.perf_counter() - t0) / CALLS * 1e6)
if R == 0:
    base = statistics.median(times["unnamed"])
    for kind, ts in times.items():
        med = statistics.median(ts)
        print(f"{kind:>18}: {med:8.1f} us per call  (+{med - base:.1f} us vs unnamed)")
hvd.shutdown()
