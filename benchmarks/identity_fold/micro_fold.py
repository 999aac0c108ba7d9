"""Single-process CPU cost of the folded identity exchange (a 1-rank ShmEngine: no waits):
min over interleaved repeats of timeit on this thread's CPU time (load-proof), us per call.

    python benchmarks/identity_fold/micro_fold.py [parts]

The headline is ``added``: negotiate's folded path around an engine allreduce of 1 KiB
(``fold.run_folded``: the cached descriptor patched, armed, written, compared, disarmed) minus
the same engine allreduce without a descriptor. The script runs on an older checkout too
(``PYTHONPATH=OLD/ddl-core:OLD/launcher``), so before and after can be run side by side.
"""

import inspect
import itertools
import sys
import time
import timeit
import types

import numpy as np

import ddl
from ddl import dtypes
from ddl.engines.shm import ShmEngine

try:  # since negotiate was split (issue 25): the control step, the format, the fold path
    from ddl.hvd import control, descriptor, fold

    state, Call, ALLREDUCE, problem = (control.global_state(), descriptor.Call,
                                       descriptor.ALLREDUCE, descriptor.problem)
    run_folded, step, mine, prepared = fold.run_folded, control.step, control.mine, fold.prepared
    where = fold.__file__
except ImportError:  # an older checkout: all of it in negotiate
    from ddl.hvd import negotiate as ng

    state, Call, ALLREDUCE, problem = ng._state, ng.Call, ng.ALLREDUCE, ng.problem
    run_folded, step, mine = ng._run_folded, ng._negotiate, ng._mine
    prepared = getattr(ng, "_prepared_fold", None)
    where = ng.__file__

kw = dict(job_id="microfold", host_index=0, local_rank=0, local_size=1, global_rank=0,
          heap_bytes=1 << 20, token=1)
eng = ShmEngine(scope="mfold", **kw)
F32, I64 = dtypes.BY_NAME["float32"], dtypes.BY_NAME["int64"]
x = np.ones(256, np.float32)

st = state
st.group = types.SimpleNamespace(rank=0, size=1, ranks=[0], engine=eng)  # no init needed
call = Call(ALLREDUCE, int(ddl.Sum), F32.code, (256,))
seqs = itertools.count()
extra = (st,) if len(inspect.signature(run_folded).parameters) == 6 else ()


def data(r):
    eng.allreduce(x, x, F32, ddl.Sum, x.shape)


if extra:
    def folded():
        run_folded(call, next(seqs), 0, data, eng, st)
else:  # the code before the cached fold
    def folded():
        run_folded(call, next(seqs), 0, data, eng)


def separate():  # the exchange as a step of its own (a joined peer's way), then the data
    step(call, next(seqs), 0, None)
    data(None)


cases = {
    "engine allreduce 1 KiB, no descriptor": lambda: data(None),
    "folded exchange + engine allreduce": folded,
    "separate exchange + engine allreduce": separate,
    "negotiate: _mine": lambda: mine(call, False, 0, 0),
    "negotiate: problem(r)": lambda: problem(mine(call, False, 0, 0)),
}
n = 5000
best = dict.fromkeys(cases, float("inf"))
for _ in range(40):  # interleaved repeats: load hits every case alike
    for k, fn in cases.items():
        best[k] = min(best[k], timeit.Timer(fn, timer=time.thread_time).timeit(number=n) / n * 1e6)
print(f"# {where}")
for k, v in best.items():
    print(f"{v:7.2f} us  {k}")
added = best["folded exchange + engine allreduce"] - best["engine allreduce 1 KiB, no descriptor"]
print(f"{added:7.2f} us  added: folded exchange over the plain engine allreduce")

if "parts" in sys.argv[1:]:
    cached = prepared(call, st)[0] if prepared is not None else None
    parts = {
        "fold_identity+cancel_fold": lambda: (eng.fold_identity(cached), eng.cancel_fold()),
        "st.folds.get(call)": lambda: st.folds.get(call),
        "hash(call)": lambda: hash(call),
    }
    for k, fn in parts.items():
        if cached is None:
            break
        v = min(timeit.Timer(fn, timer=time.thread_time).timeit(number=n) / n * 1e6
                for _ in range(5))
        print(f"{v:7.2f} us  {k}")
eng.close()
