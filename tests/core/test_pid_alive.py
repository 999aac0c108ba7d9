"""``pid_alive``: how a waiting rank decides that a peer has gone."""
import builtins
import io
import os
import subprocess
import sys
import time

from ddl.engines import shm_sync


def test_running_process_is_alive():
    assert shm_sync.pid_alive(os.getpid())


def test_zombie_counts_as_dead():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while shm_sync.pid_alive(p.pid):  # exited but not reaped: state Z
        assert time.monotonic() < deadline, "an exited child still reads as alive"
        time.sleep(0.01)
    p.wait()
    assert not shm_sync.pid_alive(p.pid)


def test_reaped_between_open_and_read_counts_as_dead(monkeypatch):
    # Seen in CI: the kernel answers ESRCH to read() on /proc/PID/stat of a process
    # reaped after open() succeeded; that must read as "dead", not escape as an error.
    class Vanishing(io.RawIOBase):
        def read(self, *_):
            raise ProcessLookupError(3, "No such process")

    real_open = builtins.open

    def fake_open(path, *a, **k):
        if str(path) == f"/proc/{os.getpid()}/stat":
            return Vanishing()
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert shm_sync.pid_alive(os.getpid()) is False
