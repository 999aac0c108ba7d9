"""Rank output: split into lines (``\\n`` and ``\\r`` both end a line, so progress bars
survive; a line longer than ``MAX_LINE`` is forwarded in pieces as it arrives), tag with
``[rank]``, write whole lines under one lock (never interleaved mid-line), copy to per-rank
log files byte for byte, and keep the last lines of every rank for failure reports. Log
paths are resolved as data by :func:`log_paths` before anything starts.
"""

from __future__ import annotations

import codecs
import os
import sys
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TextIO

MAX_LINE = 65536  # characters: longer lines are forwarded (and tagged) in pieces this long
TAIL_CHARS = 1000  # a failure report shows at most this much of one line


class LineSplitter:
    """Incremental UTF-8 decoding (invalid bytes replaced) and line splitting in linear time.

    Every line returned keeps its terminator (``\\n``, ``\\r`` or ``\\r\\n``). A line longer
    than ``max_line`` characters comes out in pieces of ``max_line`` without a terminator,
    so one huge unterminated write is forwarded as it arrives instead of held (and rescanned)
    until its end; ``None`` keeps lines whole (the agent protocol, whose messages must not be
    cut). :meth:`flush` returns the unterminated rest.
    """

    def __init__(self, max_line: int | None = MAX_LINE) -> None:
        if max_line is not None and max_line < 1:
            raise ValueError(f"max_line must be at least 1, got {max_line}")
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._max = max_line
        self._parts: list[str] = []  # the unterminated line so far, never rescanned
        self._held = 0  # characters in _parts

    def feed(self, data: bytes) -> list[str]:
        return self._split(self._decoder.decode(data))

    def _split(self, text: str) -> list[str]:
        out: list[str] = []
        if self._parts and self._parts[-1].endswith("\r"):
            # a held "\r" waited for this text: "\r\n" is one terminator, not two
            self._parts[-1] = self._parts[-1][:-1]
            self._held -= 1
            text = "\r" + text
        # str.find runs at memchr speed; a regex over every character costs 10x more
        pos, size = 0, len(text)
        nl, cr = text.find("\n"), text.find("\r")
        while nl >= 0 or cr >= 0:
            if cr < 0 or 0 <= nl < cr:
                eol, end = nl, nl + 1
            elif cr + 1 == size:
                break  # might be the first half of "\r\n": hold it for the next read
            else:
                eol, end = cr, cr + 2 if text[cr + 1] == "\n" else cr + 1
            self._take(text[pos:eol], out)
            out.append(self._joined() + text[eol:end])
            pos = end
            if nl < end:
                nl = text.find("\n", end)
            if cr < end:
                cr = text.find("\r", end)
        self._take(text[pos:], out)
        return out

    def _take(self, text: str, out: list[str]) -> None:
        """Add unterminated text to the current line, emitting full pieces of it."""
        while self._max is not None and text and self._held + len(text) > self._max:
            cut = self._max - self._held
            self._parts.append(text[:cut])
            out.append(self._joined())
            text = text[cut:]
        if text:
            self._parts.append(text)
            self._held += len(text)

    def _joined(self) -> str:
        line = "".join(self._parts)
        self._parts, self._held = [], 0
        return line

    def flush(self) -> list[str]:
        rest = self._split(self._decoder.decode(b"", final=True))
        tail = self._joined()
        return [*rest, tail] if tail else rest


@dataclass(frozen=True)
class LogPaths:
    stdout: str
    stderr: str


def log_paths(log_dir: str | None, job_id: str, ranks: Iterable[int]) -> dict[int, LogPaths]:
    """``<log_dir>/<job_id>/rank.<R>.out`` and ``.err`` for every rank (empty without
    --log-dir)."""
    if not log_dir:
        return {}
    base = os.path.join(log_dir, job_id)
    return {
        r: LogPaths(os.path.join(base, f"rank.{r}.out"), os.path.join(base, f"rank.{r}.err"))
        for r in ranks
    }


class OutputSink:
    """Where every rank's lines go. Thread-safe; one lock for the terminal."""

    def __init__(
        self,
        tag: bool = True,
        logs: Mapping[int, LogPaths] | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        tail_lines: int = 20,
    ) -> None:
        self.tag = tag
        self._out = stdout or sys.stdout
        self._err = stderr or sys.stderr
        self._lock = threading.Lock()
        self._tails: dict[int, deque[str]] = {}
        self._tail_lines = tail_lines
        self.logs: dict[int, LogPaths] = {}
        self._files: dict[tuple[int, str], TextIO] = {}
        self.open_logs(logs or {})

    def open_logs(self, logs: Mapping[int, LogPaths]) -> None:
        """Start writing these ranks' logs (ddlrun opens them once the job id, which names
        their folder, is drawn: the notes before it go to the terminal only)."""
        for rank, paths in logs.items():
            os.makedirs(os.path.dirname(paths.stdout), exist_ok=True)
            with self._lock:
                self.logs[rank] = paths
                for stream, path in (("stdout", paths.stdout), ("stderr", paths.stderr)):
                    self._files[(rank, stream)] = open(  # noqa: SIM115 - closed in close()
                        path, "w", encoding="utf-8", newline="")

    def restart_logs(self, logs: Mapping[int, LogPaths]) -> None:
        """A new start of the job (``--max-restarts``): the last one's logs are closed and
        its lines forgotten (a failure report quotes the new attempt's), these opened."""
        self.close()
        with self._lock:
            self._tails.clear()
            self.logs.clear()
        self.open_logs(logs)

    def line(self, rank: int, stream: str, text: str) -> None:
        """One line (or a piece of a long one) of a rank. The terminal gets it tagged and
        terminated; the log file gets exactly what the rank wrote."""
        shown = text if text.endswith(("\n", "\r")) else text + "\n"
        if self.tag:
            shown = f"[{rank}] {shown}"
        target = self._err if stream == "stderr" else self._out
        with self._lock:
            tail = self._tails.setdefault(rank, deque(maxlen=self._tail_lines))
            tail.append(_clip(text.rstrip("\r\n")))
            f = self._files.get((rank, stream))
            if f is not None:
                f.write(text)
                f.flush()
            self._write(target, shown)

    def raw(self, stream: str, text: str) -> None:
        """A line that is already tagged (mpirun --output tag, srun --label)."""
        if not text.endswith(("\n", "\r")):
            text += "\n"
        target = self._err if stream == "stderr" else self._out
        with self._lock:
            self._tails.setdefault(-1, deque(maxlen=self._tail_lines)).append(
                _clip(text.rstrip()))
            self._write(target, text)

    def note(self, text: str) -> None:
        """A launcher message (to stderr, prefixed ``ddlrun:``)."""
        with self._lock:
            lines = "".join(f"ddlrun: {ln}\n" for ln in text.splitlines() or [""])
            self._write(self._err, lines)

    @staticmethod
    def _write(target: TextIO, text: str) -> None:
        """Write and flush; a closed pipe (``ddlrun ... | head -1``) drops the terminal's
        copy quietly from then on (log files keep everything) instead of a traceback."""
        try:
            target.write(text)
            target.flush()
        except BrokenPipeError:
            silence(target)

    def tail(self, rank: int) -> list[str]:
        with self._lock:
            return list(self._tails.get(rank, ()))

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def silence(stream: TextIO) -> None:
    """Point a stream whose reader has gone at /dev/null, so later writes (and the flush at
    interpreter exit) do not raise BrokenPipeError."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _clip(line: str) -> str:
    if len(line) <= TAIL_CHARS:
        return line
    return f"{line[:TAIL_CHARS]}... ({len(line) - TAIL_CHARS} more characters)"
