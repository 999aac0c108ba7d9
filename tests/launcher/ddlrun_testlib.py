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
