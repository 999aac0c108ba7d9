"""Fault-injection worker for tests/launcher/test_reliability.py (needs the ddl core).

    faults.py collectives N VICTIM AT ACTION   N allreduces over ddl.malloc buffers; rank
                                               VICTIM does ACTION before collective AT:
                                               kill (SIGKILL itself), stop (SIGSTOP itself),
                                               child3 (fork a child that holds stdout, exit 3)
    faults.py malloc                           ddl.malloc, say "ready", wait to be killed
    faults.py bigline MIB N                    rank 0 writes MIB MiB without a newline in N
                                               pieces between N allreduces

Every rank first prints ``pid PID START`` (START: its /proc start time), so the tests can
check by pid that nothing outlives the job.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np

import ddl


def starttime(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[19]


def announce(pid: int) -> None:
    print(f"pid {pid} {starttime(pid)}", flush=True)


def checked_allreduce(buf: np.ndarray, rank: int, size: int) -> None:
    buf[:] = rank + 1
    out = ddl.allreduce(buf, op=ddl.Sum)
    want = size * (size + 1) / 2
    if not np.allclose(out, want):
        raise SystemExit(f"rank {rank}: wrong allreduce result {out[:4]}, want {want}")


def collectives(n: int, victim: int, at: int, action: str) -> int:
    rank, size = ddl.rank(), ddl.size()
    buf = ddl.malloc((1024,), np.float32)
    for i in range(n):
        if rank == victim and i == at:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif action == "child3":
                # a data-loader worker that outlives its parent, holding its stdout
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
                announce(child.pid)
                print(f"rank {rank} fails now", flush=True)
                os._exit(3)
        checked_allreduce(buf, rank, size)
    print(f"rank {rank} ok", flush=True)
    return 0


def bigline(mib: int, n: int) -> int:
    rank, size = ddl.rank(), ddl.size()
    piece = "y" * (mib * 2**20 // n)
    buf = np.zeros(1024, np.float32)
    for _ in range(n):
        if rank == 0:
            sys.stdout.write(piece)  # never a newline
            sys.stdout.flush()
        checked_allreduce(buf, rank, size)
    print(f"rank {rank} allreduces ok", file=sys.stderr, flush=True)
    return 0


def main() -> int:
    announce(os.getpid())
    ddl.init()
    try:
        mode = sys.argv[1]
        if mode == "collectives":
            return collectives(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        if mode == "malloc":
            ddl.malloc((1024,), np.float32)
            print("ready", flush=True)
            time.sleep(60)
            return 0
        if mode == "bigline":
            return bigline(int(sys.argv[2]), int(sys.argv[3]))
        raise SystemExit(f"unknown mode {mode}")
    finally:
        ddl.shutdown()


if __name__ == "__main__":
    sys.exit(main())
