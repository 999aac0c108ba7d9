"""Shared helpers for ddlrun tests: run ddlrun as a real process, find leftovers. (A
uniquely named module, not conftest, so it cannot collide with tests/conftest.py.)"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from procs import PY, ddlrun_argv, run_ddlrun  # noqa: F401 - the one way to run ddlrun

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "scripts" / "worker.py")
REPO = HERE.parent.parent


def procs_with(marker: str) -> list[int]:
    """PIDs whose command line contains ``marker`` (our own tests' processes only)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(d))
        except OSError:
            pass
    return found


def wait_gone(marker: str, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = procs_with(marker)
        if not left:
            return []
        time.sleep(0.1)
    return procs_with(marker)


def shm_left(job_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"ddl-{job_id}-")]


@pytest.fixture
def marker():
    m = f"ddltest-{uuid.uuid4().hex[:12]}"
    yield m
    for pid in procs_with(m):  # never leave anything behind, even when a test fails
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def janitor_of(ddlrun_pid: int, timeout: float = 5.0) -> int | None:
    """The pid of ddlrun's janitor (``ddlrun/janitor.py``, its child in a session of its
    own), found by its parent pid: None if there is none within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmdline = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == ddlrun_pid and b"janitor.py" in cmdline:
                return int(d)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def pid_alive(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` (/proc/PID/stat field 22) still
    runs: a zombie, or another process under a reused pid, is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and fields[19] == start
