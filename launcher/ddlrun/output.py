"""Rank output: split into lines (``\\n`` and ``\\r`` both end a line, so progress bars
survive; a line longer than ``MAX_LINE`` is forwarded in pieces as it arrives), tag with
``[rank]``, write whole lines under one lock (never interleaved mid-line), copy to per-rank
log files byte for byte, and keep the last lines of every rank for failure reports. Log
paths are resolved as data by :func:`log_paths` before anything starts.

The terminal copy (:class:`Terminal`) is for people watching. On a terminal a rank's
``\\r``-ended update is the one live line at the bottom: another rank's complete line is
written above it (the live line erased with ``\\r ESC[K`` and drawn again after), ``\\b``
is applied rather than echoed, and the live line is cut to the terminal's width so erasing
it leaves nothing behind. Elsewhere (a pipe, a file) ``\\r``/``\\b`` updates collapse to
each line's final state and escape codes are stripped; plain lines pass unchanged.
``--output-ranks`` hides the other ranks' lines from the terminal only (their log files,
and the tails a failure report quotes, keep them), and TensorFlow's import banners
(:func:`banner_key`) are shown once per job.
"""

from __future__ import annotations

import argparse
import codecs
import os
import re
import sys
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TextIO

MAX_LINE = 65536  # characters: longer lines are forwarded (and tagged) in pieces this long
TAIL_CHARS = 1000  # a failure report shows at most this much of one line
MAX_RANKS = 1 << 20  # --output-ranks: a range is expanded, so it must stay small


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


# ---------------------------------------------------------------------------- pure text
# CSI (colours, erase, cursor moves), OSC (titles, links) and the two-character escapes
ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
ERASE = "\r\x1b[K"  # back to column 0, clear to the end of the line


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text) if "\x1b" in text else text


def overwrite(base: str, text: str, keep_ansi: bool = False) -> str:
    """What a terminal line shows once ``text`` is written over ``base`` from column 0:
    ``\\b`` steps back one column, ``\\r`` returns to column 0, a character replaces the
    one under the cursor, escape codes take no column (kept with ``keep_ansi``, else
    dropped). Keras backs over its bar with ``\\b`` before each redraw."""
    if base:
        text = base + "\r" + text
    elif "\b" not in text and "\r" not in text:
        return text if keep_ansi else strip_ansi(text)
    cells: list[str] = []  # one visible character each, with the escape codes before it
    col, codes, pos = 0, "", 0
    for m in [*ANSI.finditer(text), None]:
        for ch in text[pos:m.start() if m else len(text)]:
            if ch == "\b":
                col = max(0, col - 1)
            elif ch == "\r":
                col = 0
            else:
                if col < len(cells):
                    cells[col] = codes + ch
                else:
                    cells.append(codes + ch)
                codes, col = "", col + 1
        if m is not None:
            if keep_ansi:
                codes += m.group()
            pos = m.end()
    return "".join(cells) + codes


def fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` visible columns (escape codes kept, colours reset after a
    cut): a live line that wrapped could not be erased by one ``ESC[K``."""
    if width <= 0 or len(text) <= width:
        return text
    out, seen, pos = [], 0, 0
    for m in [*ANSI.finditer(text), None]:
        chunk = text[pos:m.start() if m else len(text)]
        if seen + len(chunk) > width:
            out.append(chunk[:width - seen])
            return "".join(out) + ("\x1b[0m" if "\x1b" in text else "")
        out.append(chunk)
        seen += len(chunk)
        if m is not None:
            out.append(m.group())
            pos = m.end()
    return text


# What TensorFlow's C++ logging prints at import, in every process (and some lines twice:
# absl logs before InitializeLog and again after it), whatever TF_CPP_MIN_LOG_LEVEL says in
# TF 2.21. Matched by their message, after the log prefix ("I0000 00:00:1796.1 3725
# port.cc:153] " or "2024-01-01 10:00:00.1: I tensorflow/core/util/port.cc:113] ").
BANNERS = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "oneDNN custom operations are on.",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "To enable the following instructions:",
    "TF-TRT Warning: Could not find TensorRT",
    "Unable to register cuDNN factory:",
    "Unable to register cuFFT factory:",
    "Unable to register cuBLAS factory:",
    "computation placer already registered.",
)
LOG_PREFIX = re.compile(r"(?:\d{4}-\d\d-\d\d [\d:.]+: )?[IWEF][\d :.]*?[\w/.-]+\.cc:\d+\] ")
# ranks' lines as mpirun (--output tag: "[1,0]<stdout>:") and srun (--label: " 0: ") tag them
RAW_TAG = re.compile(r"\[\d+,(\d+)\]<std\w+>: ?|\s*(\d+): ")


def banner_key(text: str) -> str | None:
    """The message of a known TensorFlow banner line (shown once per job), else None."""
    message = text.rstrip("\r\n")
    m = LOG_PREFIX.match(message)
    if m is not None:
        message = message[m.end():]
    return message if message.startswith(BANNERS) else None


def tagged_rank(text: str) -> tuple[int | None, str]:
    """The rank of a line mpirun or srun tagged, and the line without its tag."""
    m = RAW_TAG.match(text)
    if m is None:
        return None, text
    return int(m.group(1) or m.group(2)), text[m.end():]


def parse_ranks(text: str) -> frozenset[int]:
    """``--output-ranks 0,2-3``: ranks and inclusive ranges, comma-separated, below
    ``MAX_RANKS`` (an argparse ``type``: a bad list is argparse's one-line error, exit 2)."""
    ranks: set[int] = set()
    for item in text.split(","):
        low, dash, high = item.strip().partition("-")
        last = high if dash else low
        if not (low.isdigit() and last.isdigit() and int(low) <= int(last) < MAX_RANKS):
            raise argparse.ArgumentTypeError(f"expected ranks and ranges such as '0' or "
                                             f"'0,2-3', got {text!r}")
        ranks.update(range(int(low), int(last) + 1))
    return frozenset(ranks)


def _ending(text: str) -> tuple[str, str]:
    """A piece split into its body and its terminator (``\\n``, ``\\r\\n``, ``\\r`` or
    none: an unterminated piece counts as a complete line)."""
    for end in ("\r\n", "\n", "\r"):
        if text.endswith(end):
            return text[:-len(end)], end
    return text, ""


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def _width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns - 1
    except (AttributeError, OSError, ValueError):
        return 0  # not a real terminal (a test's stream): no cut


@dataclass(frozen=True)
class _Live:
    key: tuple[int, str]
    stream: str
    shown: str


class Terminal:
    """The terminal copy of the job's output (not thread-safe: the sink's lock guards it).

    Each rank's unfinished line (its ``\\r`` updates so far) is held, overwritten as a
    terminal would, and written for good once the line ends (or at :meth:`finish`). A
    stream that is a TTY also shows it: as the one live line at the bottom (the rank that
    updated last owns it), below everything else written to the TTY. A stream that is not
    a TTY shows only the lines' final states, without escape codes."""

    def __init__(self, stdout: TextIO, stderr: TextIO, tty: bool | None = None) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._tty = {k: _is_tty(s) if tty is None else tty for k, s in self._streams.items()}
        self._live: _Live | None = None
        self._held: dict[tuple[int, str], tuple[str, str]] = {}  # key -> (prefix, state)

    def piece(self, key: tuple[int, str], stream: str, prefix: str, text: str) -> None:
        """One piece of a rank's output as the splitter cut it (terminator included)."""
        body, end = _ending(text)
        held = self._held.pop(key, None)
        prefix, state = held if held is not None else (prefix, "")
        line = overwrite(state, body, keep_ansi=self._tty[stream])
        if end == "\r":
            self._held[key] = (prefix, line)
            if self._tty[stream]:
                self._draw_live(key, stream, prefix + line)
        elif held is not None or "\b" in body:  # collapsed: a redraw's padding dropped
            self.write(stream, prefix + line.rstrip(" ") + "\n", key)
        else:
            self.write(stream, prefix + line + "\n", key)

    def write(self, stream: str, text: str, key: tuple[int, str] | None = None) -> None:
        """Complete lines: above the live line on a TTY (ending it when it is ``key``'s)."""
        live = self._live
        if live is None or not self._tty[stream]:
            _write(self._streams[stream], text)
        elif live.key == key and live.stream == stream:
            self._live = None  # the rank's line is done: its final state stays
            _write(self._streams[stream], ERASE + text)
        else:
            _write(self._streams[live.stream], ERASE)
            _write(self._streams[stream], text)
            _write(self._streams[live.stream], live.shown)

    def _draw_live(self, key: tuple[int, str], stream: str, shown: str) -> None:
        live = self._live
        if live is not None and live.stream != stream:
            _write(self._streams[live.stream], ERASE)
        target = self._streams[stream]
        shown = fit(shown, _width(target))
        self._live = _Live(key, stream, shown)
        _write(target, ERASE + shown)

    def finish(self) -> None:
        """The end of a job's output: every unfinished line written in its final state."""
        held, self._held = self._held, {}
        for key, (prefix, state) in held.items():
            self.write(key[1], prefix + state.rstrip(" ") + "\n", key)
        if self._live is not None:  # not reached: the live line's rank is held
            _write(self._streams[self._live.stream], "\n")
            self._live = None


def _write(target: TextIO, text: str) -> None:
    """Write and flush; a closed pipe (``ddlrun ... | head -1``) drops the terminal's copy
    quietly from then on (log files keep everything) instead of a traceback."""
    try:
        target.write(text)
        target.flush()
    except BrokenPipeError:
        silence(target)


class OutputSink:
    """Where every rank's lines go. Thread-safe; one lock for the terminal. ``ranks``
    (``--output-ranks``): only these ranks' lines reach the terminal."""

    def __init__(
        self,
        tag: bool = True,
        logs: Mapping[int, LogPaths] | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        tail_lines: int = 20,
        ranks: frozenset[int] | None = None,
        tty: bool | None = None,
    ) -> None:
        self.tag = tag
        self.ranks = ranks
        self._term = Terminal(stdout or sys.stdout, stderr or sys.stderr, tty)
        # per stream: the rank of a tagged line still open after a "\r" (mpirun and srun tag
        # lines, so the pieces after its "\r" arrive without a tag)
        self._open_raw: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._tails: dict[int, deque[str]] = {}
        self._tail_lines = tail_lines
        self._banners: set[str] = set()  # shown once per job, restarts included
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
        with self._lock:
            self._keep_tail(rank, text)
            f = self._files.get((rank, stream))
            if f is not None:
                f.write(text)
                f.flush()
            if self._shown(rank, text):
                self._term.piece((rank, stream), stream, f"[{rank}] " if self.tag else "",
                                 text)

    def raw(self, stream: str, text: str) -> None:
        """A line that is already tagged (mpirun --output tag, srun --label)."""
        rank, untagged = tagged_rank(text)
        with self._lock:
            if rank is None:
                rank = self._open_raw.get(stream)
            self._open_raw[stream] = rank if text.endswith("\r") else None
            self._keep_tail(-1, text)
            if self._shown(rank, untagged):
                # each rank's own line state: one rank's "\r" progress never takes in another's
                self._term.piece((-1 if rank is None else rank, stream), stream, "", text)

    def _keep_tail(self, rank: int, text: str) -> None:
        tail = self._tails.setdefault(rank, deque(maxlen=self._tail_lines))
        tail.append(_clip(overwrite("", text.rstrip("\r\n")).rstrip()))

    def _shown(self, rank: int | None, text: str) -> bool:
        """Whether the terminal shows this line: a chosen rank's, and a banner only once."""
        if self.ranks is not None and rank is not None and rank not in self.ranks:
            return False
        key = banner_key(text)
        if key is None:
            return True
        if key in self._banners:
            return False
        self._banners.add(key)
        return True

    def note(self, text: str) -> None:
        """A launcher message (to stderr, prefixed ``ddlrun:``)."""
        with self._lock:
            lines = "".join(f"ddlrun: {ln}\n" for ln in text.splitlines() or [""])
            self._term.write("stderr", lines)

    def tail(self, rank: int) -> list[str]:
        with self._lock:
            return list(self._tails.get(rank, ()))

    def close(self) -> None:
        with self._lock:
            self._term.finish()
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
