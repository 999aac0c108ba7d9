"""One process-set class: start / poll / close.

Every child runs in its own session (process group), so closing signals the whole tree
the child may have forked. ``close`` sends SIGTERM (or the given signal) to every group,
waits until one monotonic deadline, then SIGKILLs what is left. On Linux children also get
``PR_SET_PDEATHSIG=SIGKILL``, so they die if their supervisor is killed outright.
Exits are reported through a callback with their monotonic timestamp, so the first failure
can be told apart from the ones the teardown caused.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .output import LineSplitter


@dataclass(frozen=True)
class ProcSpec:
    key: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None = None
    stdin_pipe: bool = False


@dataclass(frozen=True)
class Exit:
    key: int
    code: int  # negative: killed by that signal (as Popen reports it)
    pid: int
    time: float


OnLine = Callable[[int, str, str], None]
OnExit = Callable[[Exit], None]


def _pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ProcessSet:
    def __init__(
        self,
        on_line: OnLine,
        on_exit: OnExit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_line = on_line
        self._on_exit = on_exit
        self._clock = clock
        self.procs: dict[int, subprocess.Popen] = {}
        self.codes: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stdin_lock = threading.Lock()

    # ------------------------------------------------------------------ start
    def start(self, specs: Iterable[ProcSpec]) -> None:
        for spec in specs:
            proc = subprocess.Popen(
                list(spec.argv),
                env=dict(spec.env),
                cwd=spec.cwd,
                stdin=subprocess.PIPE if spec.stdin_pipe else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,
            )
            self.procs[spec.key] = proc
            readers = [
                self._thread(self._read, spec.key, proc.stdout, "stdout"),
                self._thread(self._read, spec.key, proc.stderr, "stderr"),
            ]
            self._thread(self._wait, spec.key, proc, readers)

    def _thread(self, target, *args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _read(self, key: int, pipe, stream: str) -> None:
        splitter = LineSplitter()
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

    def _wait(self, key: int, proc: subprocess.Popen, readers: list[threading.Thread]) -> None:
        code = proc.wait()
        when = self._clock()
        for t in readers:  # deliver the process's last lines before its exit
            t.join(timeout=2.0)
        with self._lock:
            self.codes[key] = code
        self._on_exit(Exit(key, code, proc.pid, when))

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
                os.killpg(proc.pid, sig)

    def close(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
        """Signal every process group, wait until the deadline, then SIGKILL the rest.
        Groups of children that already exited are signalled too (grandchildren)."""
        deadline = time.monotonic() + timeout
        if self.running():
            self.signal_all(sig)
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for key in list(self.procs):
            self.close_stdin(key)
        for t in self._threads:
            t.join(timeout=2.0)
