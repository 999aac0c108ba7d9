"""Single-process cost of the folded identity path's pieces (a 1-rank ShmEngine: no waits).
min over repeats of timeit on this thread's CPU time (load-proof), us per call."""
import os
import sys
import time
import timeit

import numpy as np

import ddl
from ddl import dtypes
from ddl.engines.shm import ShmEngine
from ddl.engines.shm_meta import Fold
from ddl.hvd import negotiate as ng

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import old_engine  # noqa: E402

old_mod = old_engine.load()

kw = dict(job_id="microfold", host_index=0, local_rank=0, local_size=1, global_rank=0,
          heap_bytes=1 << 20, token=1)
new = ShmEngine(scope="mnew", **kw)
old = old_mod.ShmEngine(scope="mold", **kw)
F32, I64 = dtypes.BY_NAME["float32"], dtypes.BY_NAME["int64"]
x = np.ones(256, np.float32)
import types  # noqa: E402

ng._state.group = types.SimpleNamespace(rank=0, size=1, ranks=[0], engine=new)  # no init
call = ng.Call(ng.ALLREDUCE, int(ddl.Sum), F32.code, (256,))
d = ng._mine(call, False, 0, 0)


def folded():
    t, _ = ng._folded_pair(call)
    e = t.copy()
    e[ng.SEQ], e[ng.SEQ + ng._AGREED], e[ng.PAYLOAD] = 0, 0, 0
    f = Fold(e, ng.problem, ng._AGREED)
    new.fold_identity(f)
    new.allreduce(x, x, F32, ddl.Sum, x.shape)
    new.cancel_fold()


def folded_rooted():  # no fast path: MAX computed and problem() called
    f = Fold(ng._mine(call, False, 0, 0), ng.problem, 0)
    new.fold_identity(f)
    new.allreduce(x, x, F32, ddl.Sum, x.shape)
    new.cancel_fold()


def separate_before():  # the old exchange on the old engine: an allreduce(MAX) of int64[48]
    e = ng._mine(call, False, 0, 0)
    old.allreduce(e, e, I64, ddl.Max, e.shape)
    old.allreduce(x, x, F32, ddl.Sum, x.shape)


cases = {
    "engine before: allreduce 1 KiB": lambda: old.allreduce(x, x, F32, ddl.Sum, x.shape),
    "engine after: allreduce 1 KiB": lambda: new.allreduce(x, x, F32, ddl.Sum, x.shape),
    "engine after: exchange_identity alone": lambda: new.exchange_identity(d.copy()),
    "before: separate exchange + allreduce": separate_before,
    "after: folded (fast path) + allreduce": folded,
    "after: folded (MAX + problem) + allreduce": folded_rooted,
    "negotiate: _mine": lambda: ng._mine(call, False, 0, 0),
    "negotiate: problem(r)": lambda: ng.problem(d),
}
n = 20000
best = {k: float("inf") for k in cases}
for _ in range(7):  # interleaved repeats: load hits every case alike
    for k, fn in cases.items():
        best[k] = min(best[k], timeit.Timer(fn, timer=time.thread_time).timeit(number=n) / n * 1e6)
for k, v in best.items():
    print(f"{v:7.2f} us  {k}")

if len(sys.argv) > 1:
    from ddl.engines.shm_meta import check_identity
    f = Fold(d, ng.problem, ng._AGREED)
    parts = {
        "Fold()": lambda: Fold(d, ng.problem, ng._AGREED),
        "check_identity": lambda: check_identity(d),
        "idents.write": lambda: new._idents.write(0, d),
        "idents.same": lambda: new._idents.same(0, 21),
        "idents.flags": lambda: new._idents.flags(0),
        "idents.result": lambda: new._idents.result(0),
        "fold_identity+cancel": lambda: (new.fold_identity(f), new.cancel_fold()),
        "_folded_pair": lambda: ng._folded_pair(call),
        "MetaKey": lambda: ng.Call(1, 2, 3, (4,)),
    }
    for k, fn in parts.items():
        v = min(timeit.Timer(fn, timer=time.thread_time).timeit(number=n) / n * 1e6
                for _ in range(5))
        print(f"{v:7.2f} us  {k}")
new.close()
old.close()
