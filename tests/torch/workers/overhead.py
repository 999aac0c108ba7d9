"""Per-call time of ``hvd.allreduce`` (blocking, op=Sum) against the core's ``ddl.allreduce``
of the same tensor, which has no identity exchange: medians over interleaved repetitions,
each call timed from a barrier of the core (so neither absorbs the ranks' skew).

argv: repetitions per size (default 400 at 1 KiB; 64 MiB gets 1/40 of that, at least 7).
Prints one JSON line: {"<bytes>": {"hvd_us": median, "core_us": median}}.
"""

import json
import statistics
import sys
import time

import torch

import ddl
import ddl.torch as hvd

torch.set_num_threads(1)
hvd.init()
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
out = {}
for nbytes in (1 << 10, 64 << 20):
    x = torch.ones(nbytes // 4)
    n = reps if nbytes <= 1 << 20 else max(7, reps // 40)
    for _ in range(3):  # warm-up: first-touch of results, caches
        hvd.allreduce(x, op=hvd.Sum)
        ddl.allreduce(x, ddl.Sum)
    calls = {"hvd": lambda x=x: hvd.allreduce(x, op=hvd.Sum),
             "core": lambda x=x: ddl.allreduce(x, ddl.Sum)}
    times: dict[str, list[float]] = {"hvd": [], "core": []}
    for i in range(n):
        # each call starts right after a barrier (both ranks together), in alternating order
        for k in ("hvd", "core") if i % 2 == 0 else ("core", "hvd"):
            ddl.barrier()
            t0 = time.perf_counter()
            calls[k]()
            times[k].append(time.perf_counter() - t0)
    out[str(nbytes)] = {f"{k}_us": round(statistics.median(v) * 1e6, 1)
                        for k, v in times.items()}
hvd.shutdown()
print(json.dumps(out), flush=True)
