"""How long a restart of every node takes, torchrun's way, side by side: two node agents on
this host (2 ranks each, --nnodes 2 --max-restarts 1, meeting at a c10d-style rendezvous),
once with ``ddlrun`` (one per node) and once with ``torchrun`` itself, alternating. Rank 3
exits with code 3 half a second after its first allreduce; the figure is the time from that
exit to the last rank's first allreduce in the restarted job (process start, imports and
ddl's init included: the same worker under both launchers).

    .venv/bin/python benchmarks/node_restart.py [ROUNDS]

Prints the median seconds of each launcher over ROUNDS (default 3) alternating runs."""

from __future__ import annotations

import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = '''
import os, time
import numpy as np
import ddl
ddl.init()
r = ddl.rank()
x = np.ones(7, np.float32)
ddl.allreduce_(x, ddl.Sum)
print(f"READY {r} {time.time():.6f}", flush=True)
if r == 3 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and not os.path.exists(
        os.environ["RESTART_MARK"]):
    open(os.environ["RESTART_MARK"], "w").close()
    time.sleep(0.5)
    print(f"FAIL {time.time():.6f}", flush=True)
    os._exit(3)
for _ in range(5):
    ddl.allreduce_(x, ddl.Sum)
ddl.shutdown()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(launcher: str, tmp: str) -> float:
    """Seconds from rank 3's exit to the last rank's first allreduce after the restart."""
    bindir = os.path.dirname(sys.executable)
    port = free_port()
    worker = os.path.join(tmp, "worker.py")
    mark = os.path.join(tmp, f"mark{port}")
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"nr{port}"]
    if launcher == "torchrun":
        argv = [os.path.join(bindir, "torchrun"), *common, "--rdzv-backend", "c10d", worker]
    else:
        argv = [sys.executable, "-m", "ddlrun", *common, sys.executable, worker]
    env = {**os.environ, "DDL_JOB_SECRET": "node-restart-benchmark", "OMP_NUM_THREADS": "1",
           "RESTART_MARK": mark}
    procs = []
    for i in range(2):
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env))
        if i == 0:
            time.sleep(1.0)  # the first agent serves the rendezvous
    out = "".join(p.communicate(timeout=300)[0] for p in procs)
    if any(p.returncode for p in procs):
        raise SystemExit(f"{launcher} failed:\n{out}")
    fail = float(re.search(r"FAIL (\d+\.\d{6})", out).group(1))
    last: dict[str, float] = {}
    for rank, ts in re.findall(r"READY (\d) (\d+\.\d{6})", out):
        if float(ts) > fail:
            last[rank] = float(ts)
    assert len(last) == 4, out
    return max(last.values()) - fail


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    times: dict[str, list[float]] = {"ddlrun": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "worker.py"), "w") as f:
            f.write(WORKER)
        for _ in range(rounds):
            for launcher in times:
                times[launcher].append(one(launcher, tmp))
    for launcher, ts in times.items():
        print(f"{launcher:>9}: restart of every node {statistics.median(ts):.2f} s median "
              f"({', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
