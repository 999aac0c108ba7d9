"""One process-set class: start / poll / close.

Every child runs in its own session (process group), so closing signals the whole tree
the child may have forked. ``close`` sends SIGTERM (or the given signal) to every group,
waits until one monotonic deadline, then SIGKILLs what is left. On Linux children also get
``PR_SET_PDEATHSIG=SIGKILL``, so they die if their supervisor is killed outright: set by
``pdeath.py``, which execs the program, since no Python code may run between fork and exec
while our reader threads run (``preexec_fn``).
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
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .output import MAX_LINE, LineSplitter

# /proc/PID/stat states of a process that cannot run until somebody else acts
STUCK_STATES = {"T": "stopped (state T, SIGSTOP?)", "t": "stopped by a debugger (state t)"}


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
    program (the pipe closes empty), else the error ``Popen`` would have raised."""
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
        self._lock = threading.Lock()
        self._stdin_lock = threading.Lock()

    # ------------------------------------------------------------------ start
    def start(self, specs: Iterable[ProcSpec]) -> None:
        """Start every spec (all at once: on Linux each goes through ``pdeath.py``, whose
        exec is awaited only after all have been spawned); raise the first one's OSError
        when a program cannot be started, the others left running for ``close``."""
        started = []
        try:
            for spec in specs:
                started.append((spec, *self._spawn(spec)))
        finally:
            error = None
            for spec, proc, status_fd in started:
                failed = _exec_status(status_fd, spec.argv[0]) if status_fd is not None else None
                if failed is None:
                    self._watch(spec, proc)
                else:
                    error = error or failed
                    proc.wait()
                    for pipe in (proc.stdin, proc.stdout, proc.stderr):
                        if pipe is not None:
                            pipe.close()
        if error is not None:
            raise error

    def _spawn(self, spec: ProcSpec) -> tuple[subprocess.Popen, int | None]:
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
        except BaseException:
            if status_r is not None:
                os.close(status_r)
            raise
        finally:
            for fd in pass_fds:
                os.close(fd)
        return proc, status_r

    def _watch(self, spec: ProcSpec, proc: subprocess.Popen) -> None:
        self.procs[spec.key] = proc
        self._open_streams[spec.key] = 2
        self._readers[spec.key] = [
            self._thread(self._read, spec.key, proc.stdout, "stdout", spec.max_line),
            self._thread(self._read, spec.key, proc.stderr, "stderr", spec.max_line),
        ]
        self._thread(self._wait, spec.key, proc)

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

    def _wait(self, key: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        when = self._clock()
        with self._lock:
            self.codes[key] = code
        self._on_exit(Exit(key, code, proc.pid, when))

    def wait_output(self, key: int, timeout: float) -> bool:
        """Wait until a process's stdout and stderr have ended (True) or ``timeout``
        passed (False: something it forked still holds them)."""
        deadline = time.monotonic() + timeout
        for t in self._readers.get(key, ()):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._readers.get(key, ()))

    def stuck(self) -> dict[int, tuple[int, str]]:
        """Running children (or what they forked) that are stopped: key -> (pid, state)."""
        found = {}
        for key in self.running():
            hit = stuck_in_session(self.procs[key].pid)
            if hit is not None:
                found[key] = hit
        return found

    # ------------------------------------------------------------------ poll
    def poll(self) -> dict[int, int | None]:
        with self._lock:
            return {k: self.codes.get(k) for k in self.procs}

    def running(self) -> list[int]:
        return [k for k, p in self.procs.items() if p.poll() is None]

    def write(self, key: int, data: bytes) -> bool:
        """Write to a child's stdin (started with stdin_pipe); False if it is gone."""
        proc = self.procs.get(key)
        if proc is None or proc.stdin is None:
            return False
        with self._stdin_lock:
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False

    def close_stdin(self, key: int) -> None:
        proc = self.procs.get(key)
        if proc is not None and proc.stdin is not None:
            with self._stdin_lock, contextlib.suppress(OSError):
                proc.stdin.close()

    # ------------------------------------------------------------------ close
    def signal_all(self, sig: int) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                self._signal_group(proc.pid, sig)

    def close(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
        """Signal every process group, wait until the deadline, then SIGKILL the rest.
        Groups of children that already exited are signalled too (grandchildren)."""
        deadline = self._clock() + timeout
        if self.running():
            self.signal_all(sig)
            # a stopped process acts on nothing but SIGKILL until it is continued (a shell's
            # `kill` of a stopped job does the same)
            self.signal_all(signal.SIGCONT)
            while self.running() and self._clock() < deadline:
                self._sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - self._clock()))
        for key in list(self.procs):
            self.close_stdin(key)
        for t in self._threads:
            t.join(timeout=2.0)


def _stat_fields(pid: int, proc_dir: str) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (which may hold spaces and parentheses):
    state, ppid, pgrp, session, ..."""
    try:
        with open(f"{proc_dir}/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def proc_state(pid: int, proc_dir: str = "/proc") -> str | None:
    """The state letter of a process (R, S, D, T, t, Z, ...), None when it is gone."""
    fields = _stat_fields(pid, proc_dir)
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
        fields = _stat_fields(pid, proc_dir)
        if fields and len(fields) > 3 and fields[3] == str(sid) and fields[0] in STUCK_STATES:
            return pid, fields[0]
    return None
