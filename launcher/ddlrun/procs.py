"""One process-set class: start / poll / close.

Every child runs in its own session (process group), so closing signals the whole tree
the child may have forked. ``close`` sends SIGTERM (or the given signal) to every group,
and by pid to every *stray*: a process below a child that left its session (``setsid``, a
helper started with ``start_new_session=True``) and, in a subreaper (ddlrun, the agent:
reaper.py), every orphan given to this process; it waits until one monotonic deadline,
then SIGKILLs what is left, walking ``/proc`` again until nothing is left, and reaps the
orphans. Children that exited before ``close`` count too: their strays are ended when the
job ends, even when every rank exited 0 (as torchrun and Horovod end the whole tree).
On Linux children also get ``PR_SET_PDEATHSIG=SIGKILL``, so they die if their supervisor
is killed outright: set by ``pdeath.py``, which execs the program, since no Python code may
run between fork and exec while our reader threads run (``preexec_fn``).
``start`` returns as soon as every child is forked, each already watched: whether the
wrapper could exec the program arrives later, with the child's exit (``Exit.error``), so
nothing waits on a child that is stopped (SIGSTOP, a debugger) before its exec; ``stuck``
says which children are still that wrapper (``Stopped.starting``).
Exits are reported through a callback with their monotonic timestamp as soon as the
process is reaped, not after its output ends: a child it forked may hold the pipes open
for long, and the earliest exit (the cause) must not be reported after its consequences.
``wait_output`` then waits, bounded, for the rest of a process's output.

``stuck_in_session`` reads ``/proc`` for a stopped process (state ``T`` or ``t``) in a
child's session: a rank that cannot run never exits, so only its state can name it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from . import reaper
from .output import MAX_LINE, LineSplitter
from .reaper import Proc

# /proc/PID/stat states of a process that cannot run until somebody else acts
STUCK_STATES = {"T": "stopped (state T, SIGSTOP?)", "t": "stopped by a debugger (state t)"}
# the same, for a child stopped before its program was exec'd (still ``pdeath.py``)
STARTING_STATES = {"T": "stopped while starting (state T, SIGSTOP?)",
                   "t": "stopped by a debugger while starting (state t)"}
WRITE_TIMEOUT = 5.0  # seconds a message to a child's stdin may wait for room in the pipe
KILL_WAIT = 1.0  # seconds after the SIGKILLs that strays may take to end and be reaped

# pids of the children every ProcessSet of this process started and has not reaped yet:
# the children of ours that are not orphans (reaper.adopted)
_OWN: set[int] = set()
_OWN_LOCK = threading.Lock()


@dataclass(frozen=True)
class ProcSpec:
    key: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None = None
    stdin_pipe: bool = False
    max_line: int | None = MAX_LINE  # None: lines are protocol messages, never cut


@dataclass(frozen=True)
class Exit:
    key: int
    code: int  # negative: killed by that signal (as Popen reports it)
    pid: int
    time: float
    # the program could not be exec'd (the wrapper exits 127): what Popen would have raised
    error: OSError | None = None


class Stopped(NamedTuple):
    """A child (or a process in its session) that cannot run: see ``stuck``."""

    pid: int
    state: str  # T or t
    starting: bool  # the child is still the wrapper: its program was never exec'd


OnLine = Callable[[int, str, str], None]
OnExit = Callable[[Exit], None]
OnEof = Callable[[int], None]


_PDEATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pdeath.py")
_LINUX = sys.platform.startswith("linux")


def _pdeath_argv(argv: Iterable[str], env: Mapping[str, str], status_fd: int) -> list[str]:
    """``argv`` run through ``pdeath.py`` (see there), which dies with this process."""
    lc_ctype = "=" + env["LC_CTYPE"] if "LC_CTYPE" in env else ""
    return [sys.executable, "-I", "-S", _PDEATH, str(os.getpid()), str(status_fd), lc_ctype,
            *argv]


def _exec_status(fd: int, program: str) -> OSError | None:
    """What ``pdeath.py`` reported through its status pipe: None once it has exec'd the
    program (the pipe closes empty), else the error ``Popen`` would have raised. Blocks
    until the wrapper has exec'd or ended: only a child's own watcher thread calls it."""
    with os.fdopen(fd, "rb") as pipe:
        data = pipe.read()
    if not data:
        return None
    code = int(data)
    return OSError(code, os.strerror(code), program)


class ProcessSet:
    def __init__(
        self,
        on_line: OnLine,
        on_exit: OnExit,
        clock: Callable[[], float] = time.monotonic,
        on_eof: OnEof | None = None,
        sleep: Callable[[float], None] = time.sleep,
        signal_group: Callable[[int, int], None] = os.killpg,
    ) -> None:
        """``clock``, ``sleep`` and ``signal_group`` (``os.killpg``) are the seams the
        fake-clock tests drive: exit times, the teardown deadline and its signals."""
        self._on_line = on_line
        self._on_exit = on_exit
        self._on_eof = on_eof
        self._clock = clock
        self._sleep = sleep
        self._signal_group = signal_group
        self.procs: dict[int, subprocess.Popen] = {}
        self.codes: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._readers: dict[int, list[threading.Thread]] = {}
        self._open_streams: dict[int, int] = {}
        self._starting: set[int] = set()  # keys whose wrapper has not exec'd the program yet
        self._lock = threading.Lock()
        self._stdin_locks: dict[int, threading.Lock] = {}
        self._ids: dict[int, Proc] = {}  # key -> the child by pid and start time (Linux)

    # ------------------------------------------------------------------ start
    def start(self, specs: Iterable[ProcSpec]) -> None:
        """Start every spec and return without waiting on any: each child is watched
        (output, exit, ``stuck``, ``close``) from the moment it is forked. A program that
        cannot be exec'd is reported by its ``Exit`` (``error``, code 127); an OSError
        raised here means the fork itself failed (or, off Linux, the program is missing),
        the children started before it left for ``close``."""
        for spec in specs:
            self._spawn(spec)

    def _spawn(self, spec: ProcSpec) -> None:
        argv, pass_fds, status_r = list(spec.argv), (), None
        if _LINUX:
            status_r, status_w = os.pipe()
            argv, pass_fds = _pdeath_argv(argv, spec.env, status_w), (status_w,)
        try:
            proc = subprocess.Popen(
                argv,
                env=dict(spec.env),
                cwd=spec.cwd,
                stdin=subprocess.PIPE if spec.stdin_pipe else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=pass_fds,
            )
            self.procs[spec.key] = proc  # from here on ``close`` reaches it
            with _OWN_LOCK:
                _OWN.add(proc.pid)
            row = reaper.stat_fields(proc.pid) if _LINUX else None  # ours, unreaped: no reuse
            if row and len(row) > 19:
                self._ids[spec.key] = Proc(proc.pid, int(row[19]))
        except BaseException:
            if status_r is not None:
                os.close(status_r)
            raise
        finally:
            for fd in pass_fds:
                os.close(fd)
        self._watch(spec, proc, status_r)

    def _watch(self, spec: ProcSpec, proc: subprocess.Popen, status_fd: int | None) -> None:
        if proc.stdin is not None:  # writes wait for room with a deadline (``write``)
            os.set_blocking(proc.stdin.fileno(), False)
            self._stdin_locks[spec.key] = threading.Lock()
        if status_fd is not None:
            with self._lock:
                self._starting.add(spec.key)
        self._open_streams[spec.key] = 2
        self._readers[spec.key] = [
            self._thread(self._read, spec.key, proc.stdout, "stdout", spec.max_line),
            self._thread(self._read, spec.key, proc.stderr, "stderr", spec.max_line),
        ]
        self._thread(self._wait, spec.key, proc, status_fd, spec.argv[0])

    def _thread(self, target, *args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _read(self, key: int, pipe, stream: str, max_line: int | None) -> None:
        splitter = LineSplitter(max_line)
        fd = pipe.fileno()
        try:
            while True:
                data = os.read(fd, 65536)
                if not data:
                    break
                for line in splitter.feed(data):
                    self._on_line(key, stream, line)
        except OSError:
            pass
        finally:
            for line in splitter.flush():
                self._on_line(key, stream, line)
            pipe.close()
            with self._lock:
                self._open_streams[key] -= 1
                ended = self._open_streams[key] == 0
            if ended and self._on_eof is not None:
                self._on_eof(key)

    def _wait(self, key: int, proc: subprocess.Popen, status_fd: int | None,
              program: str) -> None:
        error = None
        if status_fd is not None:  # ends when the wrapper has exec'd, failed or was killed
            error = _exec_status(status_fd, program)
            with self._lock:
                self._starting.discard(key)
        code = proc.wait()
        when = self._clock()
        with _OWN_LOCK:
            _OWN.discard(proc.pid)
        with self._lock:
            self.codes[key] = code
        self._on_exit(Exit(key, code, proc.pid, when, error))

    def wait_output(self, key: int, timeout: float) -> bool:
        """Wait until a process's stdout and stderr have ended (True) or ``timeout``
        passed (False: something it forked still holds them)."""
        deadline = time.monotonic() + timeout
        for t in self._readers.get(key, ()):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._readers.get(key, ()))

    def stuck(self) -> dict[int, Stopped]:
        """Running children (or what they forked) that are stopped, and whether the child
        is still the wrapper (stopped before its program was exec'd)."""
        found = {}
        for key in self.running():
            hit = stuck_in_session(self.procs[key].pid)
            if hit is not None:
                with self._lock:
                    starting = key in self._starting
                found[key] = Stopped(*hit, starting)
        return found

    # ------------------------------------------------------------------ poll
    def poll(self) -> dict[int, int | None]:
        with self._lock:
            return {k: self.codes.get(k) for k in self.procs}

    def running(self) -> list[int]:
        return [k for k, p in self.procs.items() if p.poll() is None]

    def write(self, key: int, data: bytes, timeout: float = WRITE_TIMEOUT) -> bool:
        """Write to a child's stdin (started with stdin_pipe); False if it is gone, or if
        its pipe had no room for ``timeout`` seconds (a stopped child). When only part of
        ``data`` went in, its stdin is closed: the next message would be garbled."""
        proc, lock = self.procs.get(key), self._stdin_locks.get(key)
        if proc is None or proc.stdin is None or lock is None:
            return False
        deadline = time.monotonic() + timeout
        if not lock.acquire(timeout=timeout):
            return False
        try:
            fd = proc.stdin.fileno()
            view = memoryview(data)
            while view:
                left = max(0.0, deadline - time.monotonic())
                if not select.select([], [fd], [], left)[1]:
                    if len(view) < len(data):
                        proc.stdin.close()
                    return False
                with contextlib.suppress(BlockingIOError):
                    view = view[os.write(fd, view):]
            return True
        except (OSError, ValueError):  # gone (EPIPE), or stdin already closed
            return False
        finally:
            lock.release()

    def close_stdin(self, key: int) -> None:
        proc, lock = self.procs.get(key), self._stdin_locks.get(key)
        if proc is None or proc.stdin is None or lock is None:
            return
        if lock.acquire(timeout=WRITE_TIMEOUT):
            try:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            finally:
                lock.release()

    # ------------------------------------------------------------------ close
    def signal_one(self, key: int, sig: int) -> None:
        """Signal one child's process group (its exit is reported as any other)."""
        proc = self.procs.get(key)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                self._signal_group(proc.pid, sig)

    def signal_all(self, sig: int) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                self._signal_group(proc.pid, sig)

    def strays(self) -> list[Proc]:
        """What the children forked, by pid and start time: every process below a child
        still running (whatever its session), and every orphan given to this process when
        it is a subreaper (with what is below it)."""
        if not _LINUX:
            return []
        rows = reaper.table()
        roots = [p.pid for p in self._ids.values()
                 if p.pid in rows and rows[p.pid].start == p.start]
        with _OWN_LOCK:
            orphans = reaper.adopted(rows, set(_OWN))
        return ([Proc(pid, rows[pid].start) for pid in orphans]
                + reaper.descendants(rows, roots + orphans))

    def close(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
        """Signal every process group and every stray (``strays``), wait until the
        deadline, then SIGKILL the rest. Groups of children that already exited are
        signalled too (grandchildren), and their strays: what a rank left running when it
        exited 0 is ended with the job."""
        deadline = self._clock() + timeout
        strays = self.strays()
        if self.running() or strays:
            # a stopped process acts on nothing but SIGKILL until it is continued (a shell's
            # `kill` of a stopped job does the same)
            for s in (sig, signal.SIGCONT):
                self.signal_all(s)
                for stray in strays:
                    reaper.signal_proc(stray, s)
            while ((self.running() or any(map(reaper.alive, strays)))
                   and self._clock() < deadline):
                self._sleep(0.05)
        self.signal_all(signal.SIGKILL)
        self._end_strays(strays)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - self._clock()))
        for key in list(self.procs):
            self.close_stdin(key)
        for t in self._threads:
            t.join(timeout=2.0)

    def _end_strays(self, strays: list[Proc]) -> None:
        """SIGKILL every stray still alive, with those that appeared since ``strays`` was
        taken, and walk ``/proc`` again, until a walk finds none alive (what one forked
        before its SIGKILL landed shows up in the next walk) and every orphan given to us
        is reaped; at most ``KILL_WAIT`` seconds."""
        known = set(strays) | set(self.strays())
        if not known:
            return
        end = self._clock() + KILL_WAIT
        while True:
            live = [p for p in known if reaper.alive(p)]
            for stray in live:
                reaper.signal_proc(stray, signal.SIGKILL)
            with _OWN_LOCK:
                own = set(_OWN)
            unreaped = reaper.reap_orphans(own)
            found = set(self.strays()) - known
            known |= found
            if (not live and not found and not unreaped) or self._clock() >= end:
                return
            self._sleep(0.01)


def proc_state(pid: int, proc_dir: str = "/proc") -> str | None:
    """The state letter of a process (R, S, D, T, t, Z, ...), None when it is gone."""
    fields = reaper.stat_fields(pid, proc_dir)
    return fields[0] if fields else None


def stuck_in_session(sid: int, proc_dir: str = "/proc") -> tuple[int, str] | None:
    """(pid, state) of a stopped process in session ``sid``: the child itself first, then
    what it forked (a wrapper script's python). None when none is stopped."""
    state = proc_state(sid, proc_dir)
    if state in STUCK_STATES:
        return sid, state
    try:
        pids = [int(d) for d in os.listdir(proc_dir) if d.isdigit()]
    except OSError:
        return None
    for pid in sorted(pids):
        fields = reaper.stat_fields(pid, proc_dir)
        if fields and len(fields) > 3 and fields[3] == str(sid) and fields[0] in STUCK_STATES:
            return pid, fields[0]
    return None
