"""The flight recorder's cost per call, side by side: the same loops with the recorder on
(the default) and off (DDL_FLIGHT_RECORDER=0), in alternating child processes, each the
fewest microseconds of the calling thread's CPU time (``time.thread_time``: other
processes' load does not count) over several batches.

    python benchmarks/flight_overhead.py [--rounds 3]

Loops (1 rank, float32[256], Sum, in place, as benchmarks/cpu_per_call.py):
``Runtime.run`` of an empty job (what the runtime writes and nothing else),
``ddl.allreduce_`` (the runtime's entry plus the call's dtype and shape) and
``hvd.allreduce`` (the Horovod layer: its call description is made anyway).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import time
import numpy as np
import ddl
from ddl.hvd import collectives as hc
from ddl.runtime import Runtime

def best(fn, n=4000, batches=21):
    out = []
    for _ in range(batches):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        out.append((time.thread_time() - t0) / n * 1e9)
    return min(out)

ddl.init()
x = np.ones(256, np.float32)
rt, job = Runtime(), (lambda: None)
print(best(lambda: rt.run(job, "allreduce", None), n=20000),
      best(lambda: ddl.allreduce_(x, ddl.Sum)),
      best(lambda: hc.allreduce(x, op=ddl.Sum, inplace=True)))
"""
LOOPS = ("Runtime.run", "ddl.allreduce_", "hvd.allreduce")


def measure(on: bool) -> list[float]:
    env = dict(os.environ, DDL_FLIGHT_RECORDER="2048" if on else "0")
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        env.pop(v, None)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, check=True)
    return [float(v) for v in out.stdout.split()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    off: list[list[float]] = []
    on: list[list[float]] = []
    for _ in range(args.rounds):  # alternating: the machine's drift hits both alike
        off.append(measure(False))
        on.append(measure(True))
    print(f"{'loop':16} {'off ns/call':>12} {'on ns/call':>12} {'recorder ns':>12}")
    for i, name in enumerate(LOOPS):
        a, b = min(r[i] for r in off), min(r[i] for r in on)
        print(f"{name:16} {a:12.0f} {b:12.0f} {b - a:12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
