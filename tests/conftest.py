import os
import sys

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
    leaked = ddl_segments() - before
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"


@pytest.fixture
def python():
    return sys.executable
