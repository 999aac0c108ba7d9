"""Failure scenarios, chosen by argv[1]. Each rank prints one JSON line saying what it saw."""

import json
import os
import signal
import sys
import time

import numpy as np

import ddl

scenario = sys.argv[1]
ddl.init()
R, N = ddl.rank(), ddl.size()
victim = N - 1


def report(**kw):
    print(json.dumps(dict(rank=R, **kw)), flush=True)


def expect_error(fn):
    t = time.monotonic()
    try:
        fn()
    except ddl.DDLError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t
    return None, "", time.monotonic() - t


x = np.ones(1 << 16, np.float32)
for _ in range(5):
    ddl.allreduce_(x, op=ddl.Sum)

if scenario in ("kill", "exit", "stop"):
    big = np.ones(int(sys.argv[2]) if len(sys.argv) > 2 else 1000, np.float32)
    if victim == R:
        if scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif scenario == "exit":
            raise SystemExit(3)  # an error in user code: atexit runs ddl.shutdown()
        else:
            with open(os.environ["VICTIM_PIDFILE"], "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
    kind, msg, took = expect_error(lambda: [ddl.allreduce_(big, op=ddl.Sum) for _ in range(50)])
    # the engine stays failed: later calls raise at once
    kind2, msg2, _ = expect_error(lambda: ddl.allreduce_(big, op=ddl.Sum))
    report(kind=kind, msg=msg, took=took, later=kind2)
    if scenario == "stop" and R == 0:
        with open(os.environ["VICTIM_PIDFILE"]) as f:
            os.kill(int(f.read()), signal.SIGKILL)  # the stopped rank cannot exit by itself
    os._exit(0)  # a dead or stopped peer: do not wait in shutdown

elif scenario == "mismatch":
    results = {}
    cases = {
        "count": lambda: ddl.allreduce(np.ones(10 + (victim == R), np.float32), op=ddl.Sum),
        "count_large": lambda: ddl.allreduce(np.ones(200_000 + 7 * (victim == R), np.float32)),
        "dtype": lambda: ddl.allreduce(np.ones(10, np.float32 if victim != R else np.float64)),
        "op": lambda: ddl.allreduce(np.ones(10), op=ddl.Max if victim == R else ddl.Sum),
        "shape": lambda: ddl.allreduce(np.ones((2, 6) if victim == R else (3, 4), np.float32)),
        "broadcast_root": lambda: ddl.broadcast(np.ones(4), root_rank=1 if victim == R else 0),
        "allgather_rows": lambda: ddl.allgather(np.ones((2, 3 + (victim == R)), np.int32)),
        "collective": lambda: ddl.barrier() if victim == R else ddl.allreduce(np.ones(3)),
    }
    for name, fn in cases.items():
        kind, msg, _ = expect_error(fn)
        # after each mismatch the engine must still work
        ok = ddl.allreduce(np.full(5, R, np.int64), op=ddl.Sum)
        results[name] = dict(kind=kind, msg=msg, after=int(ok[0]))
    report(results=results)

elif scenario == "grouped_mismatch":
    # A grouped call's layout is part of its identity: ranks splitting the same total
    # differently used to reduce unrelated elements together, on every rank, silently.
    def grouped(sizes, n=1):
        parts = [np.full(k * n, float(i + 1), np.float32) for i, k in enumerate(sizes)]
        return lambda: ddl.grouped_allreduce_(parts, op=ddl.Sum)

    odd = victim == R
    cases = {
        "split": grouped([200, 100] if odd else [100, 200]),
        "split_large": grouped([200, 100] if odd else [100, 200], 1000),
        "count": grouped([100, 100, 100] if odd else [100, 200]),
        "vs_plain": (lambda: ddl.allreduce_(np.ones(300, np.float32), op=ddl.Sum)) if odd
        else grouped([100, 200]),
    }
    results = {}
    for name, fn in cases.items():
        kind, msg, _ = expect_error(fn)
        ok = ddl.allreduce(np.full(5, R, np.int64), op=ddl.Sum)
        results[name] = dict(kind=kind, msg=msg, after=int(ok[0]))
    same = [np.full(k, float(i + 1), np.float32) for i, k in enumerate([100, 200])]
    ddl.grouped_allreduce_(same, op=ddl.Sum)
    report(results=results, same=[float(t[0]) for t in same] + [float(t[-1]) for t in same])

elif scenario == "bad_input":
    out = {}
    for name, fn in {
        "avg_int": lambda: ddl.allreduce(np.ones(3, np.int32), op=ddl.Average),
        "min_complex": lambda: ddl.allreduce(np.ones(3, np.complex64), op=ddl.Min),
        "bad_op": lambda: ddl.allreduce(np.ones(3), op="median"),
        "scalar": lambda: ddl.allreduce(3.0),
        "list": lambda: ddl.allreduce([1, 2, 3]),
        "object": lambda: ddl.allreduce(np.array(["a"], dtype=object)),
        "out_shape": lambda: ddl.allreduce(np.ones(3), out=np.ones(4)),
        "root": lambda: ddl.broadcast(np.ones(3), root_rank=N),
        "gather_0d": lambda: ddl.allgather(np.float32(1).reshape(())),
    }.items():
        kind, msg, _ = expect_error(fn)
        out[name] = dict(kind=kind, msg=msg)
    ok = ddl.allreduce(np.ones(3), op=ddl.Sum)
    report(results=out, after=float(ok[0]))
ddl.shutdown()
