"""Pairs of 2-rank jobs started by hand on one MASTER_ADDR:MASTER_PORT without a secret, the
second 0 or 0-STAGGER s after the first: how many complete with a stranger's data (must be
0). .venv/bin/python benchmarks/jobs_on_one_port.py PAIRS SETTLE [STAGGER]"""

import os
import random
import subprocess
import sys
import time

from ddlrun.preflight import pick_free_pair as free_port  # P and P+1 free

PY = sys.executable
MIX = (
    "import os, time, numpy as np, ddl; ddl.init(); v = float(os.environ['VAL']); "
    "a = np.full(11, v, np.float64); out = float(ddl.allreduce(a, op=ddl.Sum)[0]); "
    "print('RESULT', out, flush=True); ddl.shutdown()"
)



def start(val, port, settle):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDL_", "MASTER_"))}
    env.update(
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        VAL=str(val),
        DDL_INIT_TIMEOUT="4",
        DDL_RENDEZVOUS_SETTLE=str(settle),
    )
    return [
        subprocess.Popen(
            [PY, "-c", MIX],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]


n, settle = int(sys.argv[1]), float(sys.argv[2])
stats = dict(foreign=0, ok=0, failed=0)
worst = 0
for i in range(n):
    port = free_port()
    t0 = time.monotonic()
    a = start(1.0, port, settle)
    time.sleep(random.uniform(0, float(sys.argv[3]) if len(sys.argv) > 3 else 0.05) if i % 2 else 0)
    b = start(100.0, port, settle)
    for val, job in ((1.0, a), (100.0, b)):
        outs = [p.communicate(timeout=60) for p in job]
        codes = [p.returncode for p in job]
        vals = {float(o.split()[1]) for o, _ in outs if o.startswith("RESULT")}
        if all(c == 0 for c in codes) and vals == {2 * val}:
            stats["ok"] += 1
        elif vals - {2 * val}:
            stats["foreign"] += 1
            print("FOREIGN", val, vals, codes, [e[-300:] for _, e in outs])
        else:
            stats["failed"] += 1
    worst = max(worst, time.monotonic() - t0)
print(stats, "worst pair", round(worst, 2))
