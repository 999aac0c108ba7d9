"""The timeline: where a rank's time goes, as a Chrome/Perfetto trace, and ddl's ranges in
``torch.profiler`` traces.

``DDL_TIMELINE=trace.json`` (from ``ddl.init()``) or ``hvd.start_timeline(path)`` (ddl.torch,
ddl.tensorflow) records, on every rank, one "X" (complete) event per range:

- ``queue``: from submitting a collective to its start on ddl's worker (lanes "queue #k");
- the collective itself, named by its label (``allreduce``, ``grad.bucket0``,
  ``torch.allreduce``; category ``collective``), on the thread that runs it;
- ``negotiate``: the identity exchange of a Horovod-level call (ddl.hvd);
- ``pack`` / ``unpack``: the DistributedOptimizer's copies into and out of a fusion buffer;
- ``dimJ reduce_scatter`` / ``allreduce`` / ``allgather``: each grid dimension's part of
  the multi-dimensional allreduce (jobs across hosts);
- ``peer wait``: the shared-memory engine waiting for a late peer (past its spin);
- a ``torch.distributed`` Work of the ``ddl`` backend, issue to completion, named by its
  op (``allreduce``, ``broadcast``...; category ``work``, lanes "works #k");
- ``CYCLE_START`` (instant, with ``mark_cycles``): ddl's worker woke to work after idling.

Horovod writes one file on rank 0, which coordinates and so sees every rank's negotiation.
ddl has no coordinator: each rank writes its own, ``trace.json`` -> ``trace.rank0.json``,
``trace.rank1.json`` ... (a path holding ``{rank}`` is formatted instead), pid = rank, tid =
thread. Timestamps are CLOCK_MONOTONIC microseconds, so the files of one host line up.

Cost: off, every hook is one module-attribute check (``recorder is None``) plus, where
torch may be profiling, a look at ``sys.modules`` (the core never imports a framework). On,
a hook appends a tuple to a list; the file is written (mode 0600) by ``stop()``, by
``ddl.shutdown()`` and at exit. At most ``MAX_EVENTS`` are kept (one warning after that).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from .errors import DDLConfigError, DDLError

_log = logging.getLogger("ddl")
clock = time.perf_counter  # CLOCK_MONOTONIC on Linux: the same clock in every process
MAX_EVENTS = 2_000_000
_modules = sys.modules


def rank_path(path: str, rank: int) -> str:
    """This rank's file: ``{rank}`` formatted, else ``.rankN`` before a ``.json`` suffix."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    if ext.lower() == ".json":
        return f"{root}.rank{rank}{ext}"
    return f"{path}.rank{rank}.json"


class Recorder:
    """The events of one rank: appended by any thread, written as one trace file."""

    def __init__(self, path: str, rank: int, mark_cycles: bool = False) -> None:
        self.path = path
        self.rank = rank
        self.mark_cycles = mark_cycles
        # (name, cat, thread ident or lane name, start s, end s or None for instants, args)
        self.events: list[tuple] = []
        self._full = False
        self._threads: dict[int, str] = {}
        self._lock = threading.Lock()
        self.epoch_offset_us = (time.time() - clock()) * 1e6

    def add(self, name: str, cat: str, t0: float, t1: float | None,
            args: dict | None = None, lane: str | None = None) -> None:
        events = self.events
        if len(events) >= MAX_EVENTS:
            if not self._full:
                self._full = True
                _log.warning("ddl: the timeline holds %d events and records no more; "
                             "record fewer steps (hvd.start_timeline/stop_timeline)", MAX_EVENTS)
            return
        where: Any = lane
        if where is None:
            where = threading.get_ident()
            if where not in self._threads:  # named now: it may be gone when the file is written
                self._threads[where] = threading.current_thread().name
        events.append((name, cat, where, t0, t1, args))

    # ------------------------------------------------------------------ writing
    def trace(self) -> dict:
        """The Trace Event Format object of everything recorded so far."""
        events = sorted(list(self.events), key=lambda e: (e[3], -((e[4] or e[3]) - e[3])))
        names = dict(self._threads)
        tids: dict[Any, int] = {}
        lanes: dict[str, list[float]] = {}  # lane -> end time of each sub-lane
        out: list[dict] = []
        body = []
        for name, cat, where, t0, t1, args in events:
            if isinstance(where, str):  # overlapping ranges: the first free sub-lane
                ends = lanes.setdefault(where, [])
                k = next((i for i, end in enumerate(ends) if end <= t0), len(ends))
                if k == len(ends):
                    ends.append(t1)
                else:
                    ends[k] = t1
                key: Any = (where, k)
                label = f"{where} #{k}"
            else:
                key, label = where, names.get(where, f"thread {where}")
            tid = tids.get(key)
            if tid is None:
                tid = tids[key] = len(tids) + 1
                out.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                            "args": {"name": label}})
                out.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank,
                            "tid": tid, "args": {"sort_index": tid}})
            ev = {"name": name, "cat": cat, "ts": round(t0 * 1e6, 3), "pid": self.rank,
                  "tid": tid}
            if t1 is None:
                ev.update(ph="i", s="t")
            else:
                ev.update(ph="X", dur=round(max(0.0, t1 - t0) * 1e6, 3))
            if args:
                ev["args"] = args
            body.append(ev)
        head = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]
        return {"traceEvents": head + out + body, "displayTimeUnit": "ms",
                "otherData": {"rank": self.rank, "clock": "CLOCK_MONOTONIC",
                              "epoch_offset_us": round(self.epoch_offset_us, 3)}}

    def write(self) -> None:
        """Write the file (created 0600; replaced whole, so a reader never sees half)."""
        with self._lock:
            text = json.dumps(self.trace(), separators=(",", ":"))
            tmp = f"{self.path}.tmp{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, self.path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise


recorder: Recorder | None = None  # the hooks' one check: None while the timeline is off
_start_lock = threading.Lock()
_exit_hooked = False


def start(path: str, rank: int, mark_cycles: bool = False) -> Recorder:
    """Record this rank's timeline into ``rank_path(path, rank)``. Starting it again with
    the same file goes on recording; another file ends the first (writing it)."""
    global recorder, _exit_hooked
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise DDLConfigError(f"timeline: file_path must be a non-empty path, got {path!r}")
    target = rank_path(os.fspath(path), rank)
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        raise DDLConfigError(f"timeline: {target}: the folder {folder} does not exist")
    with _start_lock:
        rec = recorder
        if rec is not None and rec.path == target:
            rec.mark_cycles = mark_cycles
            return rec
        if rec is not None:
            _stop_locked()
        recorder = Recorder(target, rank, mark_cycles)
        if not _exit_hooked:
            atexit.register(flush)
            _exit_hooked = True
        return recorder


def _stop_locked() -> None:
    global recorder
    rec, recorder = recorder, None
    if rec is not None:
        rec.write()


def stop() -> None:
    """Stop recording and write the file (nothing happens while it is off)."""
    with _start_lock:
        _stop_locked()


def flush() -> None:
    """Write what was recorded so far and keep recording (``ddl.shutdown()``, exit)."""
    rec = recorder
    if rec is not None:
        try:
            rec.write()
        except OSError as exc:
            _log.warning("ddl: could not write the timeline %s: %s", rec.path, exc)


_job_rank: int | None = None  # this process's rank while ddl is initialized


def start_from_env(rank: int, path: str | None) -> None:
    """``ddl.init()`` joined the job as ``rank``: remembered for ``start_timeline``, and
    ``DDL_TIMELINE`` (``path``) starts recording now."""
    global _job_rank
    _job_rank = rank
    if path:
        start(path, rank)


def left_job() -> None:
    """``ddl.shutdown()``: write what was recorded; ``start_timeline`` needs a new init."""
    global _job_rank
    _job_rank = None
    flush()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's ``hvd.start_timeline`` for every framework adapter (after ``init()``)."""
    rank = _job_rank
    if rank is None:
        raise DDLError("start_timeline: ddl is not initialized: call hvd.init() first")
    start(file_path, rank, mark_cycles)


def stop_timeline() -> None:
    """Horovod's ``hvd.stop_timeline``."""
    stop()


# ------------------------------------------------------------------- the hooks
def torch_profiler() -> Any:
    """``torch.autograd.profiler`` while a torch profiler records, else None; torch is
    never imported here (a program that has not imported it cannot be profiling it)."""
    prof = _modules.get("torch.autograd.profiler")
    if prof is not None and getattr(prof, "_is_profiler_enabled", False):
        return prof
    return None


class _Null:
    __slots__ = ("args",)

    def __enter__(self) -> _Null:
        return self  # what a caller sets on it (``args``) goes nowhere

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


class _Span:
    __slots__ = ("name", "cat", "args", "t0", "rf", "lane")

    def __init__(self, name: str, cat: str, args: dict | None, prof: Any,
                 lane: str | None = None) -> None:
        self.name, self.cat, self.args, self.lane = name, cat, args, lane
        self.rf = prof.record_function(f"ddl:{name}") if prof is not None else None

    def __enter__(self) -> _Span:
        if self.rf is not None:
            self.rf.__enter__()
        self.t0 = clock()
        return self

    def __exit__(self, *exc: Any) -> None:
        t1 = clock()
        if self.rf is not None:
            self.rf.__exit__(*exc)
        rec = recorder
        if rec is not None:
            rec.add(self.name, self.cat, self.t0, t1, self.args, self.lane)


def span(name: str, cat: str, args: dict | None = None) -> Any:
    """A range of this thread: a timeline event, and ``ddl:<name>`` in a torch profiler
    (torch records ranges only on threads that it profiles, such as the caller's)."""
    prof = torch_profiler()
    if recorder is None and prof is None:
        return _NULL
    return _Span(name, cat, args, prof)


def phase(name: str, cat: str, t0: float, t1: float, args: dict | None = None) -> None:
    """A range timed by the caller (``clock()`` seconds), when the timeline is on."""
    rec = recorder
    if rec is not None:
        rec.add(name, cat, t0, t1, args)


def queued(fn: Any, name: str, cycle: bool) -> Any:
    """``fn`` as ddl's worker will run it: the time it waited in the queue, then the
    collective. A torch profiler sees the whole call as ``ddl:<name>``, from submit to done:
    it records only the threads it profiles, so the range opens here, on the caller's
    thread, and closes (through a torch future, as gloo's Works do) at the end of the job,
    before the handle lets its waiters go: a profiler stopped after ``wait()`` returns
    never races with it."""
    t_submit = clock()
    prof = torch_profiler()
    ended = None
    if prof is not None:
        rf = prof.record_function(f"ddl:{name}")
        rf.__enter__()
        ended = _modules["torch"].futures.Future()
        rf._call_end_callbacks_on_future(ended)

    def job() -> Any:
        rec = recorder
        t0 = clock()
        try:
            if rec is None:
                return fn()
            rec.add("queue", "queue", t_submit, t0, {"op": name}, lane="queue")
            if cycle and rec.mark_cycles:
                rec.add("CYCLE_START", "cycle", t0, None)
            try:
                return fn()
            finally:
                rec.add(name, "collective", t0, clock())
        finally:
            if ended is not None:
                ended.set_result(None)

    return job


def inline(fn: Any, name: str) -> Any:
    """Run ``fn`` (a collective on the caller's thread) inside its range."""
    with span(name, "collective"):
        return fn()


def async_range(name: str, future: Any, cat: str = "work", lane: str = "works") -> Any:
    """A torch future's range, issue to completion: ``name`` on lane ``lane`` of the
    timeline, ``ddl:<name>`` in a torch profiler. Returns the future to hand out (the
    profiler's range ends when it completes)."""
    t0 = clock()
    prof = torch_profiler()
    if prof is not None:
        rf = prof.record_function(f"ddl:{name}")
        rf.__enter__()
        future = rf._call_end_callbacks_on_future(future)
    if recorder is not None:
        def done(_fut: Any) -> None:
            rec = recorder
            if rec is not None:
                rec.add(name, cat, t0, clock(), None, lane)

        future.add_done_callback(done)
    return future
