"""Events the backends report to the supervisor (``run.supervise``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RankExit:
    rank: int
    host_index: int
    code: int  # negative: killed by that signal
    pid: int
    time: float  # when the rank exited (launcher's monotonic clock), not when we heard of it


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


Event = RankExit | HostLost | JobExit
Emit = Callable[[Event], None]
