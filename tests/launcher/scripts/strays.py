"""A rank that leaves a helper running outside its own session (test_strays.py).

Usage: ``strays.py HOW END MARKER DIR``

- HOW ``session``: a child started with ``start_new_session=True`` (as some data-loading
  and profiling libraries do), writing to the rank's own stdout; ``daemon``: a classic
  daemon (fork, setsid, fork, the middle process exits; stdio on /dev/null).
- END ``crash``: rank 0 raises once every rank has started its helper, the others sleep
  (the teardown finds their helpers below them); ``exit0``: every rank exits 0 (their
  helpers are given to the supervisor).

Every rank waits until its helper runs, prints ``helper PID START`` (START:
/proc/PID/stat field 22), then creates ``DIR/ready-RANK``.
Rank 1's helper ignores SIGTERM, so only the SIGKILL after the deadline ends it.
"""

import os
import sys
import time

# argv: stubborn|plain MARKER READY: creates the file READY once its SIGTERM is set up
HELPER = ("import signal, sys, time\n"
          "if sys.argv[1] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "open(sys.argv[3], 'w').close()\n"
          "time.sleep(600)")


def start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[19]


def session(argv: list[str]) -> int:
    import subprocess

    return subprocess.Popen(argv, start_new_session=True).pid


def daemon(argv: list[str]) -> int:
    """fork, setsid, fork; the grandchild sends its pid up a pipe and execs ``argv``."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read_end)
            os.setsid()
            if os.fork() == 0:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.write(write_end, f"{os.getpid()}\n".encode())
                os.close(write_end)
                os.execv(sys.executable, argv)
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(middle, 0)
    with os.fdopen(read_end) as pipe:
        return int(pipe.readline())


def wait_for(path: str) -> None:
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def main() -> int:
    how, end, marker, folder = sys.argv[1:5]
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kind = "stubborn" if rank == 1 else "plain"
    helper_ready = os.path.join(folder, f"helper-{rank}")
    argv = [sys.executable, "-c", HELPER, kind, marker, helper_ready]
    pid = session(argv) if how == "session" else daemon(argv)
    wait_for(helper_ready)
    print(f"helper {pid} {start_time(pid)}", flush=True)
    open(os.path.join(folder, f"ready-{rank}"), "w").close()
    if end == "exit0":
        return 0
    if rank == 0:
        for other in range(size):
            wait_for(os.path.join(folder, f"ready-{other}"))
        raise RuntimeError("crash after starting a helper")
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
