"""Failure records: each failed rank's own account of why, and the blame drawn from them.

ddlrun gives every rank a path in ``DDL_ERROR_FILE``, in a private folder of the job on the
rank's host (``RecordFolder``: made 0700, removed at the end). A rank that dies of an
uncaught exception writes its record there (``ddl.failures``: the exception's type and
message, the user's frame, the time, and whether a peer's failure caused it); a rank
killed by a signal writes nothing. Who reads it: the local backend when the rank exits;
over ssh and blaunch the host's agent, which sends it with the rank's ``exit`` message;
under mpirun and srun ``ddlrun.rankenv`` points the ranks on ddlrun's own host (and every
rank, where the folder is on a shared filesystem) at a folder ddlrun reads after the job.

The blame (``culprit``): exit order is not cause (a peer's error is often raised before the
failing rank's interpreter has finished dying). Root causes come first: a record that is
not a peer's consequence, a rank that failed without one (killed, or dead before
``ddl.init()``), a lost host; then ranks whose record says a peer's failure caused theirs;
last, ranks without a record that SIGTERM ended (what a teardown sends). Among equals the
earliest by the record's time, else by the exit's. Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MAX_BYTES = 64 << 10  # a record is a few KiB; more is not one of ours


@dataclass(frozen=True)
class FailureRecord:
    """What a rank wrote about its failure (``ddl.failures``'s record, version 1)."""

    type: str
    message: str
    time: float  # wall clock of the rank's host, seconds since the epoch
    after_peer: bool  # a consequence of another rank's failure
    file: str = ""
    line: int = 0
    function: str = ""
    thread: str = "MainThread"
    # ddl.flight's summary: the rank's collectives (issued, unfinished, last done), its
    # waits on peers and its dump's path; None from a rank without the recorder
    flight: dict | None = field(default=None, compare=False, hash=False)

    @classmethod
    def from_json(cls, data: object) -> FailureRecord | None:
        """The record in ``data`` (a parsed JSON object), None when it is not one."""
        if not isinstance(data, dict):
            return None
        try:
            return cls(type=str(data["type"]), message=str(data.get("message", "")),
                       time=float(data["time"]), after_peer=bool(data.get("after_peer")),
                       file=str(data.get("file") or ""), line=int(data.get("line") or 0),
                       function=str(data.get("function") or ""),
                       thread=str(data.get("thread") or "MainThread"),
                       flight=data["flight"] if isinstance(data.get("flight"), dict) else None)
        except (KeyError, TypeError, ValueError):
            return None

    def to_json(self) -> dict:
        return {"type": self.type, "message": self.message, "time": self.time,
                "after_peer": self.after_peer, "file": self.file, "line": self.line,
                "function": self.function, "thread": self.thread, "flight": self.flight}

    def where(self, cwd: str | None = None) -> str:
        """``file:line`` of the user's frame (relative to ``cwd`` when under it)."""
        if not self.file:
            return ""
        path = self.file
        if cwd and os.path.isabs(path):
            rel = os.path.relpath(path, cwd)
            if not rel.startswith(".."):
                path = rel
        return f"{path}:{self.line}"

    def summary(self, cwd: str | None = None) -> str:
        """``ValueError: boom at train.py:42`` (the message's first line, cut)."""
        lines = self.message.strip().splitlines()
        first = lines[0] if lines else ""
        if len(first) > 300:
            first = first[:297] + "..."
        text = f"{self.type.removeprefix('builtins.')}: {first}" if first else self.type
        where = self.where(cwd)
        text += f" at {where}" if where else ""
        return text + (f" (in thread {self.thread})" if self.thread != "MainThread" else "")


def read_record(path: str) -> FailureRecord | None:
    """The record at ``path``; None when there is none or it is not one of ours."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_BYTES:
        return None
    try:
        return FailureRecord.from_json(json.loads(raw))
    except ValueError:
        return None


class RecordFolder:
    """A job's private folder for its ranks' records on one host (0700, new, removed by
    ``remove``); ``path(rank)`` is the rank's ``DDL_ERROR_FILE``."""

    def __init__(self, job_id: str, base: str | None = None) -> None:
        self.folder = tempfile.mkdtemp(prefix=f"ddlrun-{job_id}-", suffix=".errors", dir=base)

    def path(self, rank: int) -> str:
        return record_path(self.folder, rank)

    def read(self, rank: int) -> FailureRecord | None:
        return read_record(self.path(rank))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def record_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank-{rank}.json")


# ------------------------------------------------------------------------- blame
ROOT, CONSEQUENCE, STOPPED = 0, 1, 2  # how likely a failure is the cause: lower first


def tier(record: FailureRecord | None, code: int | None) -> int:
    """``ROOT`` for a record that is no peer's consequence and for a failure without a
    record (``code`` None: a lost host); ``CONSEQUENCE``; ``STOPPED`` for a rank without a
    record that SIGTERM ended (what teardowns send)."""
    if record is not None:
        return CONSEQUENCE if record.after_peer else ROOT
    return STOPPED if code == -signal.SIGTERM else ROOT


def blame_key(record: FailureRecord | None, code: int | None, exit_wall: float,
              exit_time: float) -> tuple[int, float, float]:
    """The sort key of one failure: its tier, then when it happened (the record's time,
    else the exit's, both wall clock), then the exit's time."""
    return (tier(record, code), record.time if record is not None else exit_wall, exit_time)


def culprit_index(keys: Sequence[tuple[int, float, float]]) -> int:
    return min(range(len(keys)), key=keys.__getitem__)


def wall_clock(clock: Callable[[], float], wall: Callable[[], float]) -> Callable[[float], float]:
    """Turns a time of ``clock`` (the supervisor's monotonic clock) into wall-clock time."""
    offset = wall() - clock()
    return lambda t: t + offset
