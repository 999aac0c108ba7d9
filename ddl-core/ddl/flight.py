"""The flight recorder: each rank's ring of its last collectives, on by default.

Every collective queued on ddl's runtime (the job's and every group's, of every engine and
framework) takes one entry: its sequence number on its queue, what it is (the spelling or
Horovod name, dtype and shape where the caller knows them), when it was queued, started and
finished, and whether it failed. The ring holds the last ``DDL_FLIGHT_RECORDER`` entries (0
turns it off); an entry is a small list written by ``ddl.runtime`` in line, under 0.2 us a
call. A call run on the caller's thread (no earlier work queued) reads the clock once: its
end is recorded as "done", and its end time is when the next call of its queue began (an
upper bound when the queue's calls come from one thread, as PyTorch's recorder records
when it discovered a completion); queued calls
read their start and end times on the runtime's thread. Engines that wait on a peer (the
shared-memory engine) note which peer, only once a wait has gone on for milliseconds
(:func:`note_wait`).

It is read when something went wrong:

- when a collective fails with a timeout, a peer's loss or a mismatch (:func:`on_failure`),
  this rank dumps the ring once, as JSON, to ``DDL_FLIGHT_DIR/rank<N>.json`` (mode 0600);
- on ``SIGURG`` (whose default action is to do nothing, so a process that never installed
  the handler is not hurt by it) a rank dumps the ring and every thread's stack: ddlrun
  sends it to the ranks still alive when a job fails, and ``ddlrun --diagnose``; under
  ddlrun, ``faulthandler`` also writes the C-level stacks to ``rank<N>.stacks.txt`` at once,
  which works even when the main thread is stuck outside Python;
- a rank's failure record (``ddl.failures``) carries :func:`summary`, so ddlrun can say
  which rank is behind and at which collective, over every launcher.

The dump's entries are ordered oldest first; times are wall-clock seconds since the epoch.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import faulthandler
import json
import logging
import os
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Protocol, runtime_checkable

from . import config
from .errors import DDLMismatchError, DDLPeerError, DDLTimeoutError

VERSION = 1
SIGNAL = signal.SIGURG
SUMMARY_DONE = 4  # finished entries a failure record carries, per queue
SUMMARY_QUEUES = 8  # queues a failure record carries: the job's, then groups with open calls
MAX_QUEUES = 64  # the job's and its groups' runtimes; older (released) ones are dropped
_TRIGGERS = (DDLTimeoutError, DDLPeerError, DDLMismatchError)

# An entry's slots (a list: made with one allocation, finished with one store).
SEQ, NAME, WHAT, QUEUED, STARTED, ENDED, ERROR = range(7)
DONE_UNTIMED = -1.0  # ENDED of a call that finished on the caller's thread (see above)

clock = time.monotonic
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_log = logging.getLogger("ddl")


class Ring:
    """The recorder of this process: each queue (a ``ddl.runtime.Runtime``) appends its
    entries in line to its own deque of the last ``size``; the newest ``MAX_QUEUES``
    queues are kept."""

    __slots__ = ("size", "queues", "rank", "folder", "dumped", "waits", "owner",
                 "_stacks")

    def __init__(self, size: int, rank: int = 0, folder: str | None = None) -> None:
        self.size = size
        self.queues: dict[int, tuple[str, collections.deque[list]]] = {}
        self.rank = rank
        self.folder = folder
        self.dumped = False
        self.waits: dict[int, tuple[int, int, int, float]] = {}  # thread -> its peer wait
        self.owner = os.getpid()
        self._stacks: Any = None

    def slots(self, queue: str) -> collections.deque[list]:
        """A new queue's deque of entries (its runtime appends them)."""
        entries: collections.deque[list] = collections.deque(maxlen=self.size)
        self.queues[id(entries)] = (queue, entries)
        while len(self.queues) > MAX_QUEUES:  # the oldest group's go; never the job's
            del self.queues[next(k for k, (q, _) in self.queues.items() if q != "job")]
        return entries

    def ordered(self) -> list[tuple[str, list, float]]:
        """(queue, entry, end) of the newest ``size`` entries of every queue, oldest first
        (by the time queued); ``end`` is the entry's end time, for a call done on the
        caller's thread the next call's start (0 when unknown or not ended)."""
        found = []
        for q, entries in list(self.queues.values()):
            mine = _copy(entries)
            for i, e in enumerate(mine):
                end = e[ENDED]
                if end == DONE_UNTIMED:
                    end = mine[i + 1][QUEUED] if i + 1 < len(mine) else 0.0
                found.append((q, e, end))
        found.sort(key=lambda qe: (qe[1][QUEUED], qe[1][SEQ]))
        return found[-self.size:]


def _copy(entries: collections.deque[list]) -> list[list]:
    """The deque's entries; another thread may append while a dump (a signal handler on
    the main thread) reads, which makes iterating fail: read again."""
    for _ in range(100):
        try:
            return list(entries)
        except RuntimeError:
            continue
    return []


def slots(queue: str) -> collections.deque[list] | None:
    """For a new runtime of ``queue``: its deque of entries; None while the recorder is
    off."""
    r = ring
    return None if r is None else r.slots(queue)


ring: Ring | None = None
_dumping = threading.Lock()  # one dump at a time; a signal during one skips (never blocks)


def start(rank: int, job_id: str) -> None:
    """Turn the recorder on for this process (``ddl.init``, once its engine is made), as
    ``DDL_FLIGHT_RECORDER`` says, with a new ring (a re-init starts afresh), and install
    the ``SIGURG`` dump."""
    global ring
    size = config.get("DDL_FLIGHT_RECORDER")
    if size <= 0:
        ring = None
        return
    ring = Ring(size, rank, config.get("DDL_FLIGHT_DIR") or default_folder(job_id))
    _install_signal(ring)


def default_folder(job_id: str) -> str:
    """Where a rank's dumps go when ``DDL_FLIGHT_DIR`` is unset (ddlrun sets it)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"ddl-flight-{uid}", job_id or f"pid{os.getpid()}")


def _install_signal(r: Ring) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers are the main thread's to set
    try:
        if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, None, _on_signal):
            return  # the program's own (or ignored on purpose): not ours to take
        signal.signal(SIGNAL, _on_signal)
        if config.get("DDL_FLIGHT_DIR"):  # under ddlrun: C-level stacks too, at once
            _ensure(r.folder)
            fd = _open_private(os.path.join(r.folder, f"rank{r.rank}.stacks.txt"),
                               os.O_WRONLY | os.O_APPEND)
            r._stacks = os.fdopen(fd, "a")
            faulthandler.register(SIGNAL, file=r._stacks, all_threads=True, chain=True)
            with os.fdopen(_open_private(os.path.join(r.folder, f"rank{r.rank}.pid"),
                                         os.O_WRONLY | os.O_TRUNC), "w") as f:
                f.write(f"{os.getpid()}\n")  # ddlrun --diagnose finds the live ranks by it
        _restartable()
    except (OSError, ValueError, RuntimeError) as exc:
        _log.warning("ddl: the flight recorder's dumps on SIGURG are off: %s", exc)


def _restartable() -> None:
    """Asking a live job must not break it: a C library's blocking call (gloo, MPI, a
    data loader's read) is restarted after the handler instead of failing with EINTR.
    Again after each signal: faulthandler's chained handler re-installs itself without."""
    signal.siginterrupt(SIGNAL, False)


def _after_fork_in_child() -> None:
    """A forked child (a data loader's worker) is not the rank: it must not dump under
    the rank's name, answer for it, or take back its files at exit."""
    global ring
    r, ring = ring, None
    if r is not None and r._stacks is not None:
        with contextlib.suppress(ValueError, RuntimeError):
            faulthandler.unregister(SIGNAL)
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(SIGNAL) is _on_signal:
                signal.signal(SIGNAL, signal.SIG_DFL)


os.register_at_fork(after_in_child=_after_fork_in_child)


def left_job() -> None:
    """``ddl.shutdown()``: stop answering ``SIGURG`` with stacks and take back this rank's
    marker and empty stacks file; the dumps stay (a job leaves only what it wrote), and the
    job's folder goes once nothing is left in it."""
    r = ring
    if r is None or r._stacks is None or r.owner != os.getpid():
        return
    with contextlib.suppress(ValueError, RuntimeError):
        faulthandler.unregister(SIGNAL)
    stacks, r._stacks = r._stacks, None
    empty = os.fstat(stacks.fileno()).st_size == 0  # faulthandler writes to the fd
    stacks.close()
    names = [f"rank{r.rank}.pid"] + ([f"rank{r.rank}.stacks.txt"] if empty else [])
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(r.folder, name))
    with contextlib.suppress(OSError):
        os.rmdir(r.folder)  # only when empty: the last rank of the host takes it


def _on_signal(signum: int, frame: Any) -> None:
    try:
        dump("asked (SIGURG): the job's launcher or ddlrun --diagnose", stacks=True)
    finally:
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            _restartable()


def note_wait(peer: int, step: int, peer_step: int, since: float) -> None:
    """This thread has waited on job rank ``peer`` since ``since`` (``clock()``) for step
    ``step``; the peer is at ``peer_step``. Called by an engine's slow wait only."""
    r = ring
    if r is not None:
        r.waits[threading.get_ident()] = (peer, step, peer_step, since)


def end_wait() -> None:
    r = ring
    if r is not None:
        r.waits.pop(threading.get_ident(), None)


def on_failure(exc: BaseException) -> None:
    """A collective failed with ``exc``: the first timeout, peer loss or mismatch of this
    process dumps the ring (the runtime calls this for every failed collective). The
    thread's noted wait stays (the failure record shows whom it waited on) until its next
    slow wait replaces it."""
    r = ring
    if r is None or r.dumped or not isinstance(exc, _TRIGGERS):
        return
    r.dumped = True
    dump(f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------- reading
@runtime_checkable
class Described(Protocol):
    """What describes itself (a Horovod-level call: ``ddl.hvd.descriptor.Call``)."""

    def describe(self) -> str: ...


def what_text(what: Any) -> str:
    """An entry's description of its tensor: a Horovod call's own description, or the
    ``(dtype, shape, op)`` a ddl.* spelling noted."""
    if what is None:
        return ""
    if isinstance(what, Described):  # a Horovod-level Call
        return what.describe()
    if isinstance(what, tuple) and len(what) == 3:
        dtype, shape, op = what
        name = str(dtype).removeprefix("torch.").removeprefix("<dtype: '").rstrip("'>")
        dims = ", ".join(str(int(d)) for d in shape) if shape is not None else "?"
        text = f"{name}[{dims}]"
        op_name = op if isinstance(op, str) else op.name if isinstance(op, enum.Enum) else None
        return text + (f", {op_name.title()}" if op_name else "")
    return str(what)


def _entry(queue: str, e: list, end: float, now_mono: float, now_wall: float) -> dict:
    def wall(t: float) -> float | None:
        return round(now_wall - (now_mono - t), 6) if t else None

    if e[ERROR] is not None:
        state = "failed"
    elif e[ENDED]:
        state = "done"
    elif e[STARTED]:
        state = "running"
    else:
        state = "queued"
    out = {"queue": queue, "seq": e[SEQ], "name": e[NAME], "what": _safe(what_text, e[WHAT]),
           "state": state, "queued": wall(e[QUEUED]), "started": wall(e[STARTED]),
           "ended": wall(end)}
    if e[ERROR] is not None:
        out["error"] = e[ERROR]
    return out


def _safe(fn: Any, *args: Any) -> str:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a dump must not fail on one odd entry
        return f"? ({type(exc).__name__})"


def snapshot(limit: int | None = None) -> dict:
    """The ring as a JSON-ready dict (``limit``: only the newest entries)."""
    r = ring
    now_mono, now_wall = clock(), time.time()
    entries = r.ordered() if r is not None else []
    if limit is not None:
        entries = entries[-limit:]
    waits = [{"peer": p, "step": s, "peer_step": ps, "since": round(now_wall - (now_mono - t), 6)}
             for p, s, ps, t in list(r.waits.values())] if r is not None else []
    return {"version": VERSION, "rank": r.rank if r else None, "pid": os.getpid(),
            "host": socket.gethostname(), "time": now_wall, "waits": waits,
            "entries": [_entry(q, e, end, now_mono, now_wall) for q, e, end in entries]}


def summary() -> dict | None:
    """What a failure record carries: per queue, the number of collectives issued, those
    not finished, and the last finished ones; the waits; the dump's path."""
    r = ring
    if r is None:
        return None
    snap = snapshot()
    qs = queues(snap["entries"], [q for q, _ in list(r.queues.values())])
    # a record has room for a few KiB: the job's queue and the groups with unfinished calls
    kept = [q for q in qs if q == "job"] + [q for q in qs if q != "job" and qs[q]["open"]]
    return {"version": VERSION, "time": snap["time"],
            "queues": {q: qs[q] for q in kept[:SUMMARY_QUEUES]},
            "waits": snap["waits"], "dump": dump_path() if r.dumped else None}


def queues(entries: list[dict], names: list[str] = ()) -> dict[str, dict]:
    """Per queue (``names``, with none issued yet, and those of ``entries``): ``issued``
    (its calls so far), ``open`` (not finished: queued, running or failed) and ``done``
    (the last finished), each cut to the newest ``SUMMARY_DONE``."""
    out: dict[str, dict] = {q: {"issued": 0, "open": [], "done": []} for q in names}
    for e in entries:
        q = out.setdefault(e["queue"], {"issued": 0, "open": [], "done": []})
        q["issued"] = max(q["issued"], e["seq"] + 1)
        (q["done"] if e["state"] == "done" else q["open"]).append(e)
    for q in out.values():
        q["done"] = q["done"][-SUMMARY_DONE:]
        q["open"] = q["open"][-SUMMARY_DONE:]
    return out


def where_now() -> dict | None:
    """The main thread's innermost frame outside ddl's package: where the program is."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return None
    return {"file": frame.f_code.co_filename, "line": frame.f_lineno,
            "function": frame.f_code.co_name}


def dump_path() -> str | None:
    r = ring
    return None if r is None or not r.folder else os.path.join(r.folder, f"rank{r.rank}.json")


def dump(reason: str, stacks: bool = False) -> str | None:
    """Write the ring (and, with ``stacks``, every thread's Python stack) to this rank's
    dump file; returns its path. None, and a warning, when the recorder is off, this is not
    the rank's process (a forked child), another dump is being written (a signal during
    one), or it could not be written; never raises: a dump must not change how the job
    ends."""
    r = ring
    path = dump_path()
    if r is None or path is None or r.owner != os.getpid():
        return None
    if not _dumping.acquire(blocking=False):
        return None
    tmp = None
    try:
        data = snapshot()
        data["reason"] = reason
        data["queues"] = queues(data["entries"])
        data["at"] = where_now()
        if stacks:
            data["stacks"] = _stacks()
        text = json.dumps(data, indent=1, default=str)
        _ensure(os.path.dirname(path))
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with os.fdopen(_open_private(tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
            f.write(text)
        os.replace(tmp, path)
        tmp = None
        return path
    except Exception as exc:  # noqa: BLE001 - reported, never raised (see above)
        _log.warning("ddl: could not write the flight recorder's dump %s: %s", path, exc)
        return None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _dumping.release()


def _stacks() -> dict[str, list[str]]:
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    me = threading.get_ident()
    frame = frames.get(me)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back  # the dump's own frames (a signal handler's) are not news
    frames[me] = frame
    return {names.get(ident, str(ident)): traceback.format_stack(f)
            for ident, f in frames.items() if f is not None}


def _open_private(path: str, flags: int) -> int:
    """``path`` opened mode 0600, never through a symbolic link."""
    return os.open(path, flags | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)


def _ensure(folder: str) -> None:
    """``folder`` and its parent (``ddl-flight-<uid>``, in a shared /tmp) made 0700, and
    refused unless they are real folders of this user that nobody else can write: another
    user must not choose where a rank's dumps go."""
    parent = os.path.dirname(folder)
    if not os.path.basename(parent).startswith("ddl-flight-"):  # a folder the user chose
        os.makedirs(parent, exist_ok=True)
        parent = folder
    for d in dict.fromkeys((parent, folder)):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
        st = os.lstat(d)
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid()
                or st.st_mode & 0o022):
            raise OSError(f"{d} is not a private folder of this user (owner uid "
                          f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): not using it")
