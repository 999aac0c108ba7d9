import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ddl_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("ddl-")}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Every test must leave /dev/shm as it found it."""
    before = ddl_segments()
    yield
    # Another job on this machine (a second test run, a benchmark) may own new segments
    # for a moment: only what stays is a leak.
    deadline = time.monotonic() + 3
    while (leaked := ddl_segments() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"


@pytest.fixture
def python():
    return sys.executable
