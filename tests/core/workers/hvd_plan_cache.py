"""hvd.allreduce through its per-signature plan cache (collectives._plan_plain_allreduce)
on N ranks: calls that differ only in dtype, op, scales or name must each get their own
plan, and a bad argument must fail every time. Prints one JSON report."""

from __future__ import annotations

import json

import numpy as np

import ddl
from ddl.hvd import collectives as C
from ddl.hvd import control, lifecycle


def main() -> dict:
    lifecycle.init()
    n, me = ddl.size(), ddl.rank()
    out: dict = {"n": n}
    seen = []
    for _ in range(3):  # every signature again: the second and third come from the cache
        f = np.full(8, 3.0 + me, np.float32)
        i = np.full(8, 3 + me, np.int32)
        seen.append([
            C.allreduce(f, op=ddl.Average).tolist()[0],
            C.allreduce(i, op=ddl.Average).tolist()[0],  # Horovod: sum, then // n (truncated)
            C.allreduce(f, op=ddl.Sum).tolist()[0],  # beside the same with other scales
            C.allreduce(f, op=ddl.Sum, postscale=2.0).tolist()[0],
            C.allreduce(f, op=ddl.Sum, prescale=0.5).tolist()[0],
            C.allreduce(f, op=ddl.Max, name="m").tolist()[0],
            str(C.allreduce(i.astype(np.int64), op=ddl.Sum).dtype),
        ])
        g = np.full(8, 1.0, np.float64)
        same = C.allreduce(g, op=ddl.Sum, inplace=True)
        seen[-1].append([same is g, float(g[0])])
        fresh = C.allreduce(g, op=ddl.Sum)
        seen[-1].append([fresh is g, float(fresh[0]), float(g[0])])
    out["seen"] = seen
    out["separate"] = control.separate_exchanges()  # before the failed calls (exchanged alone)
    errors = []
    for _ in range(2):
        try:
            C.allreduce(np.ones(4, np.float32), op="nonsense")
        except ddl.DDLError as exc:
            errors.append(type(exc).__name__)
    out["errors"] = errors
    out["plans"] = len(control.global_state().plans)
    lifecycle.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
