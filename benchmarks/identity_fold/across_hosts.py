"""Wall time per call of ``hvd.allreduce`` against the core's ``ddl.allreduce_`` on the same
array, in a job that spans (simulated) hosts: the multi-host engine, shared memory inside a
host and Gloo across. Median over interleaved batches, us per call; ``added`` is what the
Horovod layer (its identity exchange above all) costs on top of the core call.

    python benchmarks/identity_fold/across_hosts.py [--hosts 2] [--per 2] [--sizes 1K,64M]

Runs on an older checkout too (``PYTHONPATH=OLD/ddl-core:OLD/launcher``). Rank 0 prints one
``RESULT {...}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1].upper(), 1)
    return int(text.rstrip("KkMm")) * mult


def worker(sizes: list[int], batches: int) -> None:
    import ddl
    from ddl.hvd import collectives as hc
    from ddl.hvd import lifecycle

    lifecycle.init()
    out = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        reps = max(3, min(300, (8 << 20) // max(nbytes, 1)))
        cases = {"core": lambda x=x: ddl.allreduce_(x, ddl.Sum),
                 "hvd": lambda x=x: hc.allreduce(x, op=ddl.Sum, inplace=True)}
        for fn in cases.values():  # warm-up: connections, caches, plans
            for _ in range(reps):
                fn()
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(batches):
            for k, fn in cases.items():
                ddl.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[k].append((time.perf_counter() - t0) / reps * 1e6)
        med = {k: float(np.median(v)) for k, v in times.items()}
        out[str(nbytes)] = {**{k: round(v, 1) for k, v in med.items()},
                            "added": round(med["hvd"] - med["core"], 1)}
    if ddl.rank() == 0:
        print("RESULT", json.dumps({"ddl": os.path.dirname(ddl.__file__),
                                    "engine": ddl.engine_name(), **out}), flush=True)
    lifecycle.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per", type=int, default=2)
    ap.add_argument("--sizes", default="1K,64M")
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--mode", default="", help="DDL's -mode, e.g. r:2x2 (two dims across hosts)")
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", ".."))
    sys.path.insert(0, os.path.join(here, "..", "..", "tests"))
    from procs import run_workers

    from tests.core.util import hosts_env

    n = a.hosts * a.per
    env = {"OMP_NUM_THREADS": "1", **({"DDL_OPTIONS": f"-mode {a.mode}"} if a.mode else {})}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    res = run_workers(os.path.abspath(__file__), n, "--worker", a.sizes, str(a.batches),
                      env=env, timeout=900, per_rank_env=hosts_env(n, a.per))
    for r in res:
        if r.returncode != 0:
            print(r.rank, r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    lines = [ln for r in res for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    for ln in lines:
        print(ln)
    return 0 if lines else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker([_size(s) for s in sys.argv[2].split(",")], int(sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
