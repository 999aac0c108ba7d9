"""Events the backends report to the supervisor (``run.supervise``)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

from .failures import FailureRecord


def describe_code(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class RankExit:
    rank: int
    host_index: int
    code: int  # negative: killed by that signal
    pid: int
    time: float  # when the rank exited (launcher's monotonic clock), not when we heard of it
    record: FailureRecord | None = None  # its failure record, when it wrote one (failures.py)


@dataclass(frozen=True)
class HostLost:
    """A host's agent connection ended before all its ranks reported an exit."""

    host_index: int
    code: int
    message: str
    time: float


@dataclass(frozen=True)
class JobExit:
    """Single-process launchers (mpirun, srun): the launcher itself exited."""

    code: int
    time: float


@dataclass(frozen=True)
class Stuck:
    """A rank that is alive but cannot run (``/proc`` state T or t): it never exits, so its
    peers time out waiting for it and only its state names it."""

    rank: int
    host_index: int
    pid: int
    state: str
    starting: bool = False  # stopped before its program was exec'd (still ddlrun's wrapper)


@dataclass(frozen=True)
class StartFailed:
    """A program could not be exec'd at all (not found, not executable): what ``Popen``
    would have raised, reported by the rank's (or the launcher's) exit."""

    program: str
    reason: str  # the OS's words (strerror)
    time: float


@dataclass(frozen=True)
class Superseded:
    """Not a rank's event: the job this ddlrun runs one node of has moved on without this
    start of it (another node's failure, nodes joining: ``node_rdzv.watch``), so this
    node's ranks stop, and no rank is to blame."""

    reason: str
    time: float


Event = RankExit | HostLost | JobExit | StartFailed | Superseded
Emit = Callable[[Event], None]
