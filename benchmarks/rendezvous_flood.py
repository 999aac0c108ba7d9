"""Starts of a 2-rank job (with a secret) under a connection flood on its rendezvous from
another uid (nobody, its own process: 4 threads cycling up to 900 connections), as issue 28
asked. Run as root from the repository: .venv/bin/python benchmarks/rendezvous_flood.py"""

import os
import subprocess
import sys
import time

from ddlrun.preflight import pick_free_pair as free_port  # P and P+1 free

PY = sys.executable
MIX = (
    "import os, numpy as np, ddl; ddl.init(); v = float(os.environ['VAL']); "
    "print('RESULT', float(ddl.allreduce(np.full(11, v), op=ddl.Sum)[0]), flush=True); "
    "ddl.shutdown()"
)
FLOOD = r"""
import socket, sys, threading, time
from collections import deque
port, secs = int(sys.argv[1]), float(sys.argv[2])
stop = time.monotonic() + secs
count = [0]
def run():
    conns = deque()
    while time.monotonic() < stop:
        try:
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=0.5)); count[0] += 1
        except OSError:
            time.sleep(0.001); continue
        if len(conns) > 225: conns.popleft().close()
def listening():
    rows = [l.split() for l in open("/proc/net/tcp").readlines()[1:]]
    return any(r[1].endswith(":%04X" % port) and r[3] == "0A" for r in rows)
while not listening() and time.monotonic() < stop:
    time.sleep(0.005)
ts = [threading.Thread(target=run) for _ in range(4)]
[t.start() for t in ts]
while any(t.is_alive() for t in ts):
    print(count[0], flush=True); time.sleep(0.1)
"""



ok, delays, conns = 0, [], []
for i in range(20):
    port = free_port()
    flood = subprocess.Popen(
        ["/usr/bin/python3", "-c", FLOOD, str(port + 1), "30"],
        user="nobody",
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDL_", "MASTER_"))}
    env.update(
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        VAL=str(i),
        DDL_JOB_SECRET=f"s{i}",
        DDL_INIT_TIMEOUT="30",
    )
    t0 = time.monotonic()
    ranks = [
        subprocess.Popen(
            [PY, "-c", MIX],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=90) for p in ranks]
    delays.append(time.monotonic() - t0)
    flood.kill()
    conns.append(int((flood.stdout.read().split() or ["0"])[-1]))
    flood.wait()
    good = all(p.returncode == 0 for p in ranks) and all(
        o.startswith(f"RESULT {2.0 * i}") for o, _ in outs
    )
    ok += good
    if not good:
        print("FAIL", i, [e[-300:] for _, e in outs])
print(
    f"20 starts under a flood from uid nobody: {ok} completed right; start-to-end s: "
    f"median {sorted(delays)[10]:.2f}, worst {max(delays):.2f}, best {min(delays):.2f}; "
    f"flood connections per start: {sorted(conns)}"
)
