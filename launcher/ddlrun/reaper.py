"""Every process a job started, found by walking ``/proc``, ended by pid at teardown.

A rank's helper in a session of its own (``start_new_session=True``, ``setsid()``, a
double-forked daemon) is outside the rank's process group, so ``killpg`` misses it, and
when its parent exits Linux hands it to the nearest *child subreaper* among its ancestors,
else to init, where nothing of the job would ever find it again. So ddlrun and the per-host
agent call ``become_subreaper()`` (``PR_SET_CHILD_SUBREAPER``) first thing, before they
fork anything: from then on a process of the job can leave their tree only by being
reparented, and orphans are reparented to them. ``ProcessSet.close`` (procs.py) ends what
it finds below its children and, in a subreaper, every child of ours that no
``ProcessSet`` started (an orphan given to us), together with the ranks, under the same
deadline. (Orphans carry no trace of the child they came from: a subreaper runs one
``ProcessSet`` at a time, as ddlrun and the agent do.)

- ``Proc`` names one process: pid and start time (``/proc/PID/stat`` field 22, clock ticks
  since boot). ``signal_proc`` opens a pidfd, then checks the start time: the pidfd then
  holds that very process, so a pid reused since the walk is never signalled (without
  pidfds, Linux < 5.3: check, then ``kill``).
- ``reap_orphans`` waits, by their own pids, for ended children of ours that no
  ``ProcessSet`` started: never ``waitpid(-1)``, which would take the exit status of a
  child that ``Popen.wait`` waits on. Only a subreaper does it: anywhere else such a
  child is somebody else's (a test's ``Popen``).

Not used: a cgroup. It would also hold the job's processes after ddlrun itself is
SIGKILLed (then helpers go to init; the ranks die of their parent-death signal), but it
needs a writable, delegated cgroup v2 tree, which the hosts and containers we run on do
not give a user (the dev machine has cgroup v1, read-only).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

_LINUX = sys.platform.startswith("linux")
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


class Proc(NamedTuple):
    """One process: a pid and its start time (together they never name another)."""

    pid: int
    start: int


class Row(NamedTuple):
    """What a walk needs of one ``/proc/PID/stat``."""

    ppid: int
    start: int
    state: str


def stat_fields(pid: int, proc_dir: str = "/proc") -> list[str] | None:
    """``/proc/PID/stat`` after the command name (which may hold spaces and parentheses):
    state, ppid, pgrp, session, ... (the start time is the 20th); None when it is gone."""
    try:
        with open(f"{proc_dir}/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def _row(pid: int, proc_dir: str) -> Row | None:
    fields = stat_fields(pid, proc_dir)
    if not fields or len(fields) < 20:
        return None
    return Row(int(fields[1]), int(fields[19]), fields[0])


def table(proc_dir: str = "/proc") -> dict[int, Row]:
    """Every process now: pid -> (ppid, start time, state)."""
    try:
        pids = [int(d) for d in os.listdir(proc_dir) if d.isdigit()]
    except OSError:
        return {}
    rows = {}
    for pid in pids:
        row = _row(pid, proc_dir)
        if row is not None:
            rows[pid] = row
    return rows


def descendants(rows: Mapping[int, Row], roots: Iterable[int]) -> list[Proc]:
    """Every process below ``roots`` in ``rows`` (by ppid, to any depth), roots excluded."""
    children: dict[int, list[int]] = {}
    for pid, row in rows.items():
        children.setdefault(row.ppid, []).append(pid)
    todo = list(roots)
    seen = set(todo)
    found = []
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                found.append(Proc(child, rows[child].start))
                todo.append(child)
    return found


def adopted(rows: Mapping[int, Row], own: Collection[int], me: int | None = None) -> list[int]:
    """Children of ``me`` (this process) that are not in ``own`` (what our ``ProcessSet``s
    started): orphans given to us, when this process is a subreaper; none otherwise."""
    if not is_subreaper():
        return []
    me = os.getpid() if me is None else me
    return [pid for pid, row in rows.items() if row.ppid == me and pid not in own]


def alive(proc: Proc, proc_dir: str = "/proc") -> bool:
    """Running (or stopped): not ended, not a zombie, and its pid not reused."""
    row = _row(proc.pid, proc_dir)
    return row is not None and row.start == proc.start and row.state not in ("Z", "X")


def signal_proc(proc: Proc, sig: int) -> bool:
    """Send ``sig`` to exactly that process; False when it is gone (or not ours to
    signal)."""
    try:
        fd: int | None = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfds here: check, then kill
        fd = None
    try:
        row = _row(proc.pid, "/proc")
        if row is None or row.start != proc.start:
            return False
        if fd is None:
            os.kill(proc.pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def reap_orphans(own: Collection[int]) -> list[int]:
    """Wait for (reap) every ended child that no ``ProcessSet`` started (not in ``own``),
    by its pid; the pids of such children still running. Nothing outside a subreaper."""
    left = []
    for pid in adopted(table(), own):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped meanwhile
            continue
        if not done:
            left.append(pid)
    return left


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: object) -> int:
    return _libc().prctl(option, arg, ctypes.c_ulong(0),
                                                   ctypes.c_ulong(0), ctypes.c_ulong(0))


def become_subreaper() -> bool:
    """Make this process the one its orphaned descendants are reparented to (Linux only;
    not inherited by children). True when it took effect."""
    if not _LINUX:
        return False
    with contextlib.suppress(OSError, AttributeError):
        return _prctl(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1)) == 0
    return False


def is_subreaper() -> bool:
    if not _LINUX:
        return False
    value = ctypes.c_int(0)
    with contextlib.suppress(OSError, AttributeError):
        return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.pointer(value)) == 0 and bool(value.value)
    return False
