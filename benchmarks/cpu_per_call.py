"""CPU time per call on the caller's thread, 1 rank: ``ddl.allreduce_`` and the Horovod
layer's ``hvd.allreduce`` of float32[256] (1 KiB), min over 25 batches of 2000 calls of
``time.thread_time`` (load-proof: other processes' CPU does not count).

    python benchmarks/cpu_per_call.py
    PYTHONPATH=OLD/ddl-core:OLD/launcher python benchmarks/cpu_per_call.py   # an older tree

It uses only ``ddl.init``, ``ddl.allreduce_`` and ``ddl.hvd.collectives.allreduce``, so the
same file runs on older checkouts (benchmarks/before_after.sh).
"""

import time

import numpy as np

import ddl
from ddl.hvd import collectives as hc


def best(fn, n: int = 2000, batches: int = 25) -> float:
    """Fewest microseconds of this thread's CPU per call of ``fn`` over ``batches``."""
    times = []
    for _ in range(batches):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        times.append((time.thread_time() - t0) / n * 1e6)
    return min(times)


def main() -> None:
    ddl.init()
    x = np.ones(256, np.float32)
    core = best(lambda: ddl.allreduce_(x, ddl.Sum))
    hvd = best(lambda: hc.allreduce(x, op=ddl.Sum, inplace=True))
    print(f"{ddl.engine_name()} core {core:.3f} us hvd {hvd:.3f} us")


if __name__ == "__main__":
    main()
