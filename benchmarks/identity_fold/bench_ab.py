"""A/B in one job, call by call (2 local ranks): the shm engine before/after the split
(raw engine.allreduce on two engines of the same job), and hvd.allreduce with the identity
exchange separate (as before) or folded, against the core's ddl.allreduce_.

    python benchmarks/identity_fold/bench_ab_drive.py  (runs this as 2 ranks through tests/procs.py)
argv: reps at 1 KiB (64 MiB gets reps // 50, at least 10) [cpu: time this thread's CPU
time, not wall time; with DDL_SHM_WAIT=futex waits then cost none]. Rank 0 prints RESULT.
"""
import json
import os
import statistics
import sys
import time

import numpy as np

import ddl
import ddl.engines
import ddl.hvd  # noqa: F401
from ddl import api, dtypes
from ddl.engines.shm import ShmEngine as NewShm
from ddl.hvd import collectives as hc
from ddl.hvd import control, lifecycle
from ddl.hvd import negotiate as ng

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import old_engine  # noqa: E402

old_mod = old_engine.load()

reps = int(sys.argv[1])
lifecycle.init()
w = api._w()
kw = dict(api._shm_kwargs(), heap_bytes=1 << 20)
common = dict(job_id=w.job_id, host_index=w.host_index, local_rank=w.local_rank,
              local_size=w.local_size, global_rank=w.rank, timeout=60.0)
old = old_mod.ShmEngine(scope="abold", **common, **kw)
new = NewShm(scope="abnew", **common, **kw)
job = api.job_engine()
orig_may_fold = ng.engine_for  # what negotiate.run_step asks
F32 = dtypes.BY_NAME["float32"]


def separate():  # the protocol as before: an allreduce(MAX) of the descriptor of its own
    ng.engine_for = lambda call, st: None
    job.exchange_identity = None


def folded():
    ng.engine_for = orig_may_fold
    job.__dict__.pop("exchange_identity", None)


CLOCK = time.thread_time if "cpu" in sys.argv[2:] else time.perf_counter


def timed(fn):
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


out = {}
for nbytes, n in ((1024, reps), (64 << 20, max(10, reps // 50))):
    x = np.ones(nbytes // 4, np.float32)
    t = {k: [] for k in ("eng_before", "eng_after", "core", "hvd_separate", "hvd_folded")}
    sep0 = control.separate_exchanges()
    for i in range(n + 5):
        row = {}
        # the order alternates: the first call of a pair absorbs the ranks' skew
        for k in (("eng_before", "eng_after") if i % 2 else ("eng_after", "eng_before")):
            eng = old if k == "eng_before" else new
            row[k] = timed(lambda eng=eng, x=x: eng.allreduce(x, x, F32, ddl.Sum, x.shape))
        row["core"] = timed(lambda x=x: ddl.allreduce_(x, ddl.Sum))
        for k in (("hvd_separate", "hvd_folded") if i % 2 else ("hvd_folded", "hvd_separate")):
            separate() if k == "hvd_separate" else folded()
            row[k] = timed(lambda x=x: hc.allreduce(x, op=ddl.Sum, inplace=True))
        folded()
        if i >= 5:  # warm-up
            for k, v in row.items():
                t[k].append(v)
    res = {k: 1e6 * statistics.median(v) for k, v in t.items()}
    res["ratio_eng_after_before"] = statistics.median(
        a / b for a, b in zip(t["eng_after"], t["eng_before"]))
    res["over_separate"] = 1e6 * statistics.median(
        a - b for a, b in zip(t["hvd_separate"], t["core"]))
    res["over_folded"] = 1e6 * statistics.median(
        a - b for a, b in zip(t["hvd_folded"], t["core"]))
    res["separate_exchanges"] = control.separate_exchanges() - sep0
    out[nbytes] = res
old.close()
new.close()
if ddl.rank() == 0:
    print("RESULT", json.dumps(out), flush=True)
lifecycle.shutdown()
