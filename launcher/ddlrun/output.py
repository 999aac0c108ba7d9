"""Rank output: split into lines (``\\n`` and ``\\r`` both end a line, so progress bars
survive), tag with ``[rank]``, write whole lines under one lock (never interleaved
mid-line), copy to per-rank log files, and keep the last lines of every rank for failure
reports. Log paths are resolved as data by :func:`log_paths` before anything starts.
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


class LineSplitter:
    """Incremental UTF-8 decoding (invalid bytes replaced) and line splitting. Every line
    returned keeps its terminator (``\\n``, ``\\r`` or ``\\r\\n``); :meth:`flush` returns
    the unterminated rest."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""

    def feed(self, data: bytes) -> list[str]:
        self._buf += self._decoder.decode(data)
        return self._split()

    def _split(self) -> list[str]:
        lines = []
        start = 0
        buf = self._buf
        i = 0
        while i < len(buf):
            ch = buf[i]
            if ch == "\n" or ch == "\r":
                end = i + 1
                if ch == "\r":
                    if end == len(buf):
                        break  # might be the first half of \r\n: wait for more
                    if buf[end] == "\n":
                        end += 1
                lines.append(buf[start:end])
                start = i = end
                continue
            i += 1
        self._buf = buf[start:]
        return lines

    def flush(self) -> list[str]:
        self._buf += self._decoder.decode(b"", final=True)
        rest, self._buf = self._buf, ""
        if not rest:
            return []
        if rest.endswith("\r"):
            return [rest]
        return [rest]


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
        self.logs = dict(logs or {})
        self._files: dict[tuple[int, str], TextIO] = {}
        for rank, paths in self.logs.items():
            os.makedirs(os.path.dirname(paths.stdout), exist_ok=True)
            self._files[(rank, "stdout")] = open(paths.stdout, "w", encoding="utf-8", newline="")  # noqa: SIM115
            self._files[(rank, "stderr")] = open(paths.stderr, "w", encoding="utf-8", newline="")  # noqa: SIM115

    def line(self, rank: int, stream: str, text: str) -> None:
        if not text.endswith(("\n", "\r")):
            text += "\n"
        shown = f"[{rank}] {text}" if self.tag else text
        target = self._err if stream == "stderr" else self._out
        with self._lock:
            tail = self._tails.setdefault(rank, deque(maxlen=self._tail_lines))
            tail.append(text.rstrip("\r\n"))
            f = self._files.get((rank, stream))
            if f is not None:
                f.write(text)
                f.flush()
            target.write(shown)
            target.flush()

    def raw(self, stream: str, text: str) -> None:
        """A line that is already tagged (mpirun --output tag, srun --label)."""
        if not text.endswith(("\n", "\r")):
            text += "\n"
        target = self._err if stream == "stderr" else self._out
        with self._lock:
            self._tails.setdefault(-1, deque(maxlen=self._tail_lines)).append(text.rstrip())
            target.write(text)
            target.flush()

    def note(self, text: str) -> None:
        """A launcher message (to stderr, prefixed ``ddlrun:``)."""
        with self._lock:
            for ln in text.splitlines() or [""]:
                self._err.write(f"ddlrun: {ln}\n")
            self._err.flush()

    def tail(self, rank: int) -> list[str]:
        with self._lock:
            return list(self._tails.get(rank, ()))

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
