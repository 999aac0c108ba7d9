"""Failure records: why this rank failed, written where the launcher reads it (as torchrun's
error files), and what its peers are told when it leaves.

``ddl.init()`` calls :func:`install`: ``sys.excepthook`` and ``threading.excepthook`` are
chained (the previous hook still runs, after ours). An uncaught exception then

- writes this rank's record to the path ``DDL_ERROR_FILE`` names (ddlrun gives every rank
  one, in a private folder of the job; unset: no record), as one JSON object written to a
  temporary name and renamed into place (mode 0600);
- on the main thread, marks the process as leaving with that exception: the engines tell
  the peers waiting for this rank that its process is exiting, and why
  (:func:`leaving`), instead of that it called ``ddl.shutdown()``.

At exit (``api``'s atexit hook calls :func:`at_exit` before ``ddl.shutdown()``), an
exception that another excepthook kept from ours (``sys.last_value``) is recorded too. A
rank killed by a signal writes nothing: the launcher knows the signal.

The record (``version`` 1): ``rank``, ``pid``, ``host``, ``time`` (seconds since the
epoch), ``type`` (module-qualified name), ``message``, ``file``/``line``/``function`` (the
user's frame: the innermost frame outside ddl's own package, preferring the program's own
code to the libraries'), ``after_peer`` (whether the exception is a consequence of another
rank's failure: ddl raised a DDLPeerError or DDLTimeoutError in this process and this
exception is one, was raised while handling one, or carries its message on), ``thread``,
``traceback`` (its last lines) and ``flight`` (``ddl.flight.summary()``: the collectives
this rank issued and had not finished, or null). A main-thread record replaces a thread's; otherwise
the first one stays.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from . import config, flight
from .errors import DDLError, peer_failures

VERSION = 1
MESSAGE_CHARS = 4000
TRACEBACK_CHARS = 8000
REASON_CHARS = 100  # what the peers are told: "ValueError: boom", cut to this

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = tuple(sorted({os.path.abspath(p) + os.sep for p in (
    sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    if p}))
_log = logging.getLogger("ddl")
_lock = threading.Lock()
_installed = False
_owner = 0  # the pid that installed the hooks: a forked child (a data-loader worker) that
# dies of an exception must not write its parent's record
_written: str | None = None  # None, "thread" or "main": which record this process wrote
_leaving: str | None = None  # None while this process is not exiting; else the reason


def install() -> None:
    """Chain ``sys.excepthook`` and ``threading.excepthook`` (once per process)."""
    global _installed, _owner
    with _lock:
        if _installed:
            return
        _installed, _owner = True, os.getpid()
    previous, previous_thread = sys.excepthook, threading.excepthook

    def excepthook(kind: type[BaseException], value: BaseException,
                   tb: TracebackType | None) -> None:
        _guarded(on_uncaught, value, True)
        if value is not None and value.__traceback__ is tb:
            _guarded(for_user, value)
            tb = value.__traceback__
        previous(kind, value, tb)

    def thread_excepthook(args: Any) -> None:
        if args.exc_type is not SystemExit:
            thread = getattr(args.thread, "name", None) or "a thread"
            _guarded(on_uncaught, args.exc_value, False, thread)
            value = args.exc_value
            if value is not None and value.__traceback__ is args.exc_traceback:
                _guarded(for_user, value)
                args = threading.ExceptHookArgs(
                    (args.exc_type, value, value.__traceback__, args.thread))
        previous_thread(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook


def _guarded(fn, *args) -> None:
    """Never let recording a failure hide it (the previous hook still prints it)."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - best effort, on the way down
        pass


def on_uncaught(exc: BaseException | None, main: bool, thread: str = "MainThread") -> None:
    """An exception nobody caught: record it, and on the main thread mark the process as
    leaving because of it."""
    global _leaving, _written
    if exc is None or os.getpid() != _owner:
        return
    if main:
        _leaving = reason(exc)
    with _lock:
        if _written == "main" or (_written == "thread" and not main):
            return
        _written = "main" if main else "thread"
    path = config.get("DDL_ERROR_FILE")
    if path:
        write(path, record(exc, thread))


def at_exit() -> None:
    """The interpreter is exiting (api's atexit hook, before ``ddl.shutdown()``): the
    process leaves, with the main thread's uncaught exception when there is one (kept in
    ``sys.last_value`` even when a later excepthook did not call ours)."""
    global _leaving
    exc = getattr(sys, "last_value", None)
    if isinstance(exc, BaseException) and _written != "main":
        _guarded(on_uncaught, exc, True)
    if _leaving is None:
        _leaving = ""


def leaving() -> str | None:
    """None while this process is not exiting (a ``ddl.shutdown()`` of the program's own);
    else why it exits: the uncaught exception (``"ValueError: boom"``), or "" for none."""
    return _leaving


def reason(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def after_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a consequence of another rank's failure: it, its cause or the
    exception it was raised while handling is a ddl error that says so, or carries the
    message of one that ddl raised in this process (``errors.peer_failures``)."""
    known = peer_failures()
    for e in _chain(exc, lambda e: [e.__cause__, e.__context__,
                                    *getattr(e, "exceptions", ())]):
        if isinstance(e, DDLError) and e.after_peer:
            return True
        try:
            text = str(e)
        except Exception:  # noqa: BLE001 - a broken __str__ says nothing
            text = ""
        if any(m in text for m in known):
            return True
    return False


def _chain(exc: BaseException, links: Callable[[BaseException], list]
           ) -> Iterator[BaseException]:
    """Each exception of ``exc``'s chain once; ``links(e)``, asked after the caller has
    had ``e`` (it may change what ``e`` links to), names the ones ``e`` leads to."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += links(e)


def user_frame(tb: TracebackType | None) -> tuple[str, int, str]:
    """(file, line, function) of the innermost frame outside ddl's own package: the
    program's own code first, else a library's; ("", 0, "") without a traceback."""
    frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(tb)]
    outside = [f for f in frames if _whose(f[0]) in ("library", "program")]
    own = [f for f in outside if _whose(f[0]) == "program"]
    for found in (own, outside, frames):
        if found:
            return found[-1]
    return "", 0, ""


def _whose(filename: str) -> str:
    """Whose code a file is: "ddl" (this package), "library" (the interpreter's and
    installed packages'), "program" (the user's own), or "" (``<stdin>``, ``<string>``)."""
    if filename.startswith("<"):
        return ""
    path = os.path.abspath(filename)
    if path.startswith(_PACKAGE):
        return "ddl"
    return "library" if path.startswith(_LIBRARIES) else "program"


def ours(tb: TracebackType) -> bool:
    """Whether the traceback entry is a frame of ddl's own package."""
    return _whose(tb.tb_frame.f_code.co_filename) == "ddl"


def short_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` with ddl's frames cut to two: the call the program made into ddl (the
    outermost) and the line of ddl that raised (the innermost of ddl's), or the one that
    called into the program's code that raised. Frames before the first of ddl's and after
    the last of ddl's stay, and so do the program's own between them (a callback ddl
    called); library frames between them go with ddl's. Unchanged when it holds at most
    two of ddl's."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    mine = [i for i, e in enumerate(entries) if ours(e)]
    if len(mine) <= 2:
        return entries[0] if entries else None
    first, last = mine[0], mine[-1]
    between = [e for e in entries[first + 1 : last] if _programs(e)]  # its callbacks
    kept = entries[: first + 1] + between + entries[last:]
    out = None
    for e in reversed(kept):
        line = e.tb_lineno if e.tb_lineno is not None else -1
        out = TracebackType(out, e.tb_frame, e.tb_lasti, line)
    return out


def _programs(tb: TracebackType) -> bool:
    """Whether the entry is a frame of the program's own code (neither ddl's nor a
    library's): a callback ddl called (a hook, a compressor) stays in a short traceback."""
    return _whose(tb.tb_frame.f_code.co_filename) == "program"


def _internal(exc: BaseException) -> bool:
    """One of ddl's own exception classes that is no error (an outcome passed between its
    layers, such as the engine's ``Unfolded``; they say so with ``ddl_internal``): never
    shown to a user."""
    return getattr(type(exc), "ddl_internal", False) is True


def for_user(exc: BaseException) -> BaseException:
    """``exc`` as the program's user sees it (its printed traceback, the failure record)
    unless ``DDL_DEBUG=1``: the traceback through ddl cut to two of its frames
    (:func:`short_traceback`), and ddl's internal chain not shown (the context of a
    DDLError, whose message says what happened and why; a context or cause of one of
    ddl's internal classes). An explicit cause that is an error (a DDLError a program
    raised its own error from, an OSError) stays. Changed in place, for each exception
    of the chain that stays, after the failure record is written from the whole chain;
    returns ``exc``."""
    if config.get("DDL_DEBUG"):
        return exc
    shown = lambda e: [e.__cause__] + ([] if e.__suppress_context__ else [e.__context__])
    for e in _chain(exc, shown):
        e.__traceback__ = short_traceback(e.__traceback__)
        if isinstance(e, DDLError) or (e.__context__ is not None
                                       and _internal(e.__context__)):
            e.__suppress_context__ = True
        if e.__cause__ is not None and _internal(e.__cause__):
            e.__cause__ = None
            e.__suppress_context__ = True
    return exc


def record(exc: BaseException, thread: str = "MainThread") -> dict:
    """The failure record of ``exc`` (see the module's docstring)."""
    file, line, function = user_frame(exc.__traceback__)
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001
        message = "<the exception's message could not be read>"
    tb = "".join(traceback.format_exception(exc))
    return dict(version=VERSION, rank=_rank(), pid=os.getpid(), host=socket.gethostname(),
                time=time.time(), type=name, message=message[:MESSAGE_CHARS],
                file=file, line=line, function=function, after_peer=after_peer(exc),
                thread=thread, traceback=tb[-TRACEBACK_CHARS:], flight=_flight())


def _flight() -> dict | None:
    """The flight recorder's summary: what this rank's collectives were doing."""
    try:
        return flight.summary()
    except Exception:  # noqa: BLE001 - the record matters more than its extra
        return None


def _rank() -> int | None:
    try:
        return config.get("RANK")
    except DDLError:
        return None


def write(path: str, rec: dict) -> bool:
    """Write ``rec`` to ``path`` whole (a temporary file renamed into place), mode 0600."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(rec, f, default=str)  # an odd name in the flight summary stays text
        os.replace(tmp, path)
    except OSError as exc:
        _log.warning("[ddl] cannot write this rank's failure record to %s (DDL_ERROR_FILE): "
                     "%s", path, exc.strerror or exc)
        return False
    return True
