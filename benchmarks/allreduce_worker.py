"""The multi-host benchmarks' allreduce worker: one engine, in-place float32 sums, one JSON
line per size on rank 0 (``benchmarks/multihost_allreduce.py`` and ``sim_validation.py``
start it on every rank of a ddlrun job, and read it back as ``Result`` rows)::

    ddlrun -n 4 python benchmarks/allreduce_worker.py --engine ddl --sizes 4194304,16777216

Per size: warm up, pick on rank 0 an iteration count that fills ``--target-seconds``, time
``--reps`` repetitions of back-to-back calls (their median is the figure, robust to the odd
slow call on a shared machine), then check the result. The engines and the checks are
ddl-perf's own (``ddl.perf.worker``, ``ddl.perf.collectives``); ``ddl-perf allreduce`` is
the nccl-tests-compatible table of the same engines. Once ``python -m ddl.perf.worker``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np

from ddl.perf.allreduce import OURS
from ddl.perf.collectives import DTYPES, Counts, busbw, count_wrong, expected, rank_input
from ddl.perf.worker import Harness, make_engines


@dataclass(frozen=True)
class Result:
    """One engine at one rank count and size, as the worker's JSON line reports it."""

    engine: str
    ranks: int
    nbytes: int
    median: float  # seconds per allreduce
    times: tuple[float, ...]
    correct: bool

    @property
    def busbw(self) -> float:
        return busbw(self.nbytes, self.median, self.ranks)


def human(nbytes: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << k and nbytes % (1 << k) == 0:
            return f"{nbytes >> k} {unit}"
    return f"{nbytes} B"


def table(results: Sequence[Result], engines: Sequence[str], markdown: bool = False,
          ours: Sequence[str] = OURS) -> str:
    """One row per (ranks, size); time and busbw per engine; then, for each of ``ours``,
    the time ratio against every other engine (peer time / our time)."""
    by = {(r.engine, r.ranks, r.nbytes): r for r in results}
    keys = sorted({(r.ranks, r.nbytes) for r in results})
    ratios = [(a, b) for a in ours if a in engines for b in engines if b not in ours]
    head = ["ranks", "size"]
    for e in engines:
        head += [f"{e} us", f"{e} GB/s"]
    head += [f"{a}/{b}" for a, b in ratios]
    rows = []
    for n, nb in keys:
        row = [str(n), human(nb)]
        for e in engines:
            r = by.get((e, n, nb))
            row += ["-", "-"] if r is None else [f"{r.median * 1e6:.1f}", f"{r.busbw:.2f}"]
        for a, b in ratios:
            ra, rb = by.get((a, n, nb)), by.get((b, n, nb))
            row.append(f"{rb.median / ra.median:.2f}x" if ra and rb else "-")
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = ["# " + fmt.format(*head)] + ["  " + fmt.format(*r) for r in rows]
    return "\n".join(lines)


def run(engine: str, sizes: list[int], reps: int, target: float, out: IO[str]) -> int:
    """Per size: warm up, pick on rank 0 an iteration count that fills ``target`` seconds,
    time ``reps`` repetitions of in-place float32 sums (median), then check the result."""
    harness = Harness()
    fp32 = DTYPES["float"]
    plug = make_engines([engine], harness.rank, harness.size, "cpu", "allreduce", fp32,
                        "sum")[0]
    bad = 0
    for nbytes in sizes:
        c = max(1, nbytes // 4)
        counts = Counts(c, c, c)
        call = plug.prepare("allreduce", counts, fp32, "sum", 0, True)
        call.load(rank_input("allreduce", counts, harness.rank, harness.size, "sum", fp32))
        for _ in range(3):
            call.run()
        harness.barrier()
        t = time.perf_counter()
        call.run()
        one = max(time.perf_counter() - t, 1e-7)
        iters = harness.broadcast_int(int(min(20000, max(2, target / one))))
        times = []
        for _ in range(reps):
            harness.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                call.run()
            times.append((time.perf_counter() - t) / iters)
        call.load(rank_input("allreduce", counts, harness.rank, harness.size, "sum", fp32))
        call.run()
        want = expected("allreduce", counts, harness.rank, harness.size, "sum", fp32)
        ok = count_wrong(call.result(), want) == 0
        bad += not ok
        if harness.rank == 0:
            rec = {"engine": engine, "ranks": harness.size, "bytes": c * 4, "iters": iters,
                   "times": times, "median": float(np.median(times)), "correct": ok}
            print(json.dumps(rec), file=out, flush=True)
    plug.close()
    harness.close()
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/allreduce_worker.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("ddl", "ddl-heap", "gloo", "mpi"), required=True)
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--target-seconds", type=float, default=0.2)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run(a.engine, sizes, a.reps, a.target_seconds, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
