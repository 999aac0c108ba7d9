"""Horovod-level calls where the identity exchange is folded into the call's first step: the
shared-memory engine's on one host, the first message across hosts on several
(engines/identity_round.py). argv[1]: the scenario; prints one JSON report."""

from __future__ import annotations

import json
import sys

import numpy as np

import ddl
from ddl.hvd import collectives as C
from ddl.hvd import control, lifecycle
from ddl.hvd import join as J


def calls() -> dict:
    """100 calls of every foldable kind; the results, and the separate exchanges."""
    me, n = ddl.rank(), ddl.size()
    before = control.separate_exchanges()
    wrong = []
    for i in range(100):
        numel = (256, 1 << 18)[i % 2]  # the one-step and the chunked algorithms
        x = np.full(numel, float(me + i), np.float32)
        got = C.allreduce(x, op=ddl.Sum)
        if not np.all(got == sum(r + i for r in range(n))):
            wrong.append(("allreduce", i))
    g = C.grouped_allreduce([np.ones(3, np.float64) * me, np.ones((2, 2), np.int32)],
                            op=ddl.Sum)
    if not (np.all(g[0] == sum(range(n))) and np.all(g[1] == n)):
        wrong.append(("grouped_allreduce", 0))
    ag = C.allgather(np.full((me + 1, 2), me, np.int64))
    if ag.shape != (sum(range(1, n + 1)), 2):
        wrong.append(("allgather", 0))
    b = C.broadcast(np.full(5, me + 7.0), 1)
    if not np.all(b == 8.0):
        wrong.append(("broadcast", 0))
    return {"separate": control.separate_exchanges() - before, "wrong": wrong}


def expect_error(fn) -> dict:
    try:
        fn()
    except ddl.DDLError as exc:
        return {"type": type(exc).__name__, "text": str(exc)}
    return {"type": None, "text": ""}


def mismatch() -> dict:
    """Calls that differ between the ranks raise on both; the job goes on after each."""
    me = ddl.rank()
    out = {}
    out["numel"] = expect_error(lambda: C.allreduce(np.ones(256 * (me + 1), np.float32),
                                                    op=ddl.Sum, name="grads"))
    # chunked (reduce-scatter) sizes: the first step stages data, nobody reads a peer's
    out["numel_large"] = expect_error(
        lambda: C.allreduce(np.ones((1 << 18) + 64 * me, np.float32), op=ddl.Sum))
    out["kind"] = expect_error(
        lambda: C.allreduce(np.ones(8, np.float32)) if me == 0
        else C.broadcast(np.ones(8, np.float32), 0))
    out["failed"] = expect_error(
        lambda: C.allreduce(np.ones(8, np.float32), op=ddl.Sum) if me == 0
        else C.broadcast(np.ones(8, np.float32), 5))
    after = C.allreduce(np.full(4, 1.0, np.float32), op=ddl.Sum)
    out["after_ok"] = bool(np.all(after == ddl.size()))
    before = control.separate_exchanges()
    C.allreduce(np.ones(4, np.float32))
    out["separate_after"] = control.separate_exchanges() - before
    # a core call on one rank against a Horovod-level call on the other: both raise where
    # the ranks share memory (a core call carries no identity across hosts)
    if ddl.engine_name() != "shm":
        return out
    out["mixed"] = expect_error(
        lambda: ddl.allreduce_(np.ones(8, np.float32), ddl.Sum) if me == 0
        else C.allreduce(np.ones(8, np.float32), op=ddl.Sum))
    return out


def joined() -> dict:
    """Rank 1 joins at once; rank 0 goes on with folded calls its peer serves."""
    me = ddl.rank()
    sums = []
    if me == 0:
        for numel in (16, 1 << 18, 16):
            sums.append(float(C.allreduce(np.ones(numel, np.float32), op=ddl.Sum)[0]))
    last = J.join()
    after = C.allreduce(np.ones(4, np.float32), op=ddl.Sum)
    return {"sums": sums, "last": last, "after": float(after[0])}


def main() -> int:
    lifecycle.init()
    report = {"calls": calls, "mismatch": mismatch, "join": joined}[sys.argv[1]]()
    report["rank"] = ddl.rank()
    report["engine"] = ddl.engine_name()
    print(json.dumps(report), flush=True)
    lifecycle.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
