"""A read-only output (a numpy array with writeable=False) given to a call that writes its
result there: refused while the call is planned, before any data moves, on every rank that
has one, and the job goes on in step. Before, numpy's ValueError came after the peers'
data had moved and left the engine unusable. Each case is followed by checked calls.
Prints one JSON line."""

import json

import numpy as np
from outcome import record

import ddl

ddl.init()
R, N = ddl.rank(), ddl.size()
ODD = R == N - 1  # the rank whose output is read-only


def ro(a: np.ndarray, read_only: bool = True) -> np.ndarray:
    a.flags.writeable = not read_only
    return a


def ones(read_only: bool) -> np.ndarray:
    return ro(np.ones(16, np.float32), read_only)


STRIDED = np.ones((4, 8), np.float32)[:, ::2]  # staged through a copy, written back
CASES = {
    # in place, on one rank (the others' calls meet its refusal: DDLMismatchError)
    "inplace": lambda: ddl.allreduce_(ones(ODD), ddl.Sum),
    "inplace_async": lambda: ddl.allreduce_async_(ones(ODD), ddl.Sum).wait(),
    "strided": lambda: ddl.allreduce_(ro(STRIDED.copy() if not ODD else STRIDED, ODD),
                                      ddl.Sum),
    "out": lambda: ddl.allreduce(ones(False), ddl.Sum, out=ro(np.empty(16, np.float32), ODD)),
    "broadcast": lambda: ddl.broadcast_(ones(ODD), root_rank=0),
    "grouped": lambda: ddl.grouped_allreduce_([ones(False), ones(ODD)], ddl.Sum),
    # on every rank: each refuses, nobody waits for a partner
    "everyone": lambda: ddl.allreduce_(ones(True), ddl.Sum),
}
out = {"rank": R}
for name, call in CASES.items():
    record(out, name, call)
    after = [ddl.allreduce(np.full(16, float(i + R), np.float32), ddl.Sum) for i in range(3)]
    want = [i * N + N * (N - 1) / 2 for i in range(3)]
    out[f"{name}_after"] = all(bool(np.all(a == w)) for a, w in zip(after, want))
# the refused read-only arrays were never written
out["untouched"] = bool(np.all(STRIDED == 1))
print(json.dumps(out), flush=True)
ddl.shutdown()
