"""CPU cost per call of the Horovod layer: ``hvd.allreduce`` against the core's
``ddl.allreduce_`` on the same array, 1 KiB float32, min over interleaved repeats of
``time.thread_time`` (load-proof), us per call.

    python benchmarks/identity_fold/hvd_overhead.py [REPS]          # 1 rank, in this process
    python benchmarks/identity_fold/hvd_overhead.py --ranks 2 [REPS]  # 2 local ranks, shm

The same script runs on an older checkout (``PYTHONPATH=OLD/ddl-core:OLD/launcher``): it
uses only ``ddl.hvd.collectives.allreduce``, ``ddl.allreduce_`` and ``lifecycle.init``.
With 2 ranks every call waits for the peer, so waits run on futexes (``DDL_SHM_WAIT=futex``)
and cost this thread no CPU; ``--profile`` prints a cProfile of the hvd calls instead.
Rank 0 prints one JSON line ``RESULT {...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _measure(reps: int, rounds: int, nbytes: int) -> dict:
    import ddl
    from ddl.hvd import collectives as hc

    x = np.ones(nbytes // 4, np.float32)
    cases = {
        "core": lambda: ddl.allreduce_(x, ddl.Sum),
        "hvd": lambda: hc.allreduce(x, op=ddl.Sum, inplace=True),
    }
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):  # interleaved: load hits both alike
        for k, fn in cases.items():
            ddl.barrier()  # both ranks start each batch together
            t0 = time.thread_time()
            for _ in range(reps):
                fn()
            best[k] = min(best[k], (time.thread_time() - t0) / reps * 1e6)
    best["overhead"] = best["hvd"] - best["core"]
    return best


def _profile(reps: int) -> None:
    import cProfile
    import pstats

    import ddl
    from ddl.hvd import collectives as hc

    x = np.ones(256, np.float32)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        hc.allreduce(x, op=ddl.Sum, inplace=True)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def worker(argv: list[str]) -> None:
    reps, rounds, nbytes, profile = int(argv[0]), int(argv[1]), int(argv[2]), argv[3] == "1"
    import ddl
    from ddl.hvd import lifecycle

    lifecycle.init()
    for _ in range(200):  # warm-up: caches filled, pages touched
        ddl.allreduce_(np.ones(nbytes // 4, np.float32), ddl.Sum)
    if profile:
        if ddl.rank() == 0:
            _profile(reps)
        else:
            _profile(reps)  # the peer must take part in every call
    else:
        res = _measure(reps, rounds, nbytes)
        if ddl.rank() == 0:
            print("RESULT", json.dumps({"ddl": os.path.dirname(ddl.__file__), **res}),
                  flush=True)
    lifecycle.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("reps", nargs="?", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--bytes", type=int, default=1024)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    args = [str(a.reps), str(a.rounds), str(a.bytes), "1" if a.profile else "0"]
    if a.ranks == 1:
        worker(args)
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "tests"))
    from procs import run_workers

    env = {"DDL_SHM_WAIT": "futex"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    res = run_workers(os.path.abspath(__file__), a.ranks, "--worker", *args, env=env,
                      timeout=900)
    for r in res:
        if r.returncode != 0 or a.profile:
            print(r.rank, r.returncode, r.stdout[-6000:], r.stderr[-3000:])
    lines = [ln for r in res for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    for ln in lines:
        print(ln)
    return 0 if lines or a.profile else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
