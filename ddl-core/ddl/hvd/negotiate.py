"""Submitting a Horovod-level call, and its handle (every framework).

Every Horovod-level call is exactly one *negotiated* call, whatever happens on this rank
(:mod:`ddl.hvd.control` says why): :func:`submit` plans the call on the caller's thread and
queues one job that runs, on the worker, the call's identity exchange (folded into its
data's first step where it can be: :mod:`ddl.hvd.fold`) and then its data. What a call is,
on the wire, is :mod:`ddl.hvd.descriptor`. A call that fails here while it is planned still
queues its exchange, marked FAILED, so that every rank raises together. ``*_async`` calls
return a :class:`Handle`, which post-processes the result on ``wait()``.

Callers that build calls import the kinds and :class:`~ddl.hvd.descriptor.Call` from here
as well as from :mod:`ddl.hvd.descriptor` (the adapters name them through this module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import ddl
from ddl import api as _api
from ddl import runtime as _runtime

from .control import (
    Retry,
    _State,
    engine_step,
    global_state,
    next_seq,
    observe,
    running,
    step,
)
from .descriptor import (
    ADD_PROCESS_SET,
    ALLGATHER,
    ALLGATHER_OBJECT,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    BROADCAST_OBJECT,
    GROUPED_ALLGATHER,
    GROUPED_ALLREDUCE,
    GROUPED_BROADCAST,
    GROUPED_REDUCE_SCATTER,
    JOINED,
    NAMES,
    PAYLOAD,
    PLAN,
    REDUCE_SCATTER,
    REMOVE_PROCESS_SET,
    SHUTDOWN,
    Call,
    buckets,
    code_of,
    engine_op,
    layout,
)
from .fold import engine_for, run_folded

__all__ = [
    "ADD_PROCESS_SET", "ALLGATHER", "ALLGATHER_OBJECT", "ALLREDUCE", "ALLTOALL", "BARRIER",
    "BROADCAST", "BROADCAST_OBJECT", "GROUPED_ALLGATHER", "GROUPED_ALLREDUCE",
    "GROUPED_BROADCAST", "GROUPED_REDUCE_SCATTER", "JOINED", "NAMES", "PAYLOAD", "PLAN",
    "REDUCE_SCATTER", "REMOVE_PROCESS_SET", "SHUTDOWN", "Call", "Handle", "Planned",
    "buckets", "code_of", "engine_op", "fail_here", "global_state", "layout", "run_step",
    "submit",
]


class Planned(NamedTuple):
    """A call ready to queue: its identity, its data step (given the exchange's result),
    what to do with the result on ``wait()``, work to run right before the exchange on the
    worker thread (packing a fusion buffer), and the payload length it announces."""

    call: Call
    data: Callable[[np.ndarray], Any]
    finish: Callable[[Any], Any] | None = None
    before: Callable[[], None] | None = None
    payload: int = 0


class Handle(_runtime.Handle):
    """An ``*_async`` result of a Horovod-level call, of every framework (``ddl.Handle``'s
    kind for them): ``wait()`` returns it, after any post-processing (scaling,
    decompression, copies); ``poll()`` says whether it is ready. It waits on the queued
    work's handle (``inner``: a ``QueuedHandle``, or a ``NamedHandle`` for a named call);
    ``Handle.ready`` wraps a finished result."""

    __slots__ = ("_inner", "_finish", "_seq", "_done", "_value", "_st")

    def __init__(self, inner: _runtime.Handle | None, seq: int,
                 finish: Callable[[Any], Any] | None = None, name: str = "",
                 st: _State | None = None) -> None:
        super().__init__(name)
        self._inner, self._seq, self._finish = inner, seq, finish
        self._done, self._value, self._st = False, None, st

    @classmethod
    def ready(cls, value: Any, name: str = "") -> Handle:
        """A handle for work already finished on this thread."""
        h = cls(None, -1, None, name)
        h._done, h._value = True, value
        return h

    def poll(self) -> bool:
        return self._done or self._inner.poll()

    def wait(self, timeout: float | None = None) -> Any:
        """The result; ``timeout`` seconds at most (a ``DDLTimeoutError`` after it, and the
        call stays pending), forever by default as in Horovod's ``synchronize``."""
        if not self._done:
            try:
                value = self._inner.wait(timeout)
            except ddl.DDLTimeoutError:
                if timeout is not None and not self._inner.poll():
                    raise  # still pending: the sequence has not moved past it
                observe(self._seq, self._st)
                raise
            except BaseException:
                observe(self._seq, self._st)
                raise
            observe(self._seq, self._st)
            self._value = self._finish(value) if self._finish else value
            self._done = True
        return self._value

    def __repr__(self) -> str:
        return f"<ddl.hvd.Handle {self.name or '?'} {'done' if self.poll() else 'pending'}>"


def _check_name(name: str, kind: int, st: _State) -> None:
    fn = NAMES.get(kind, "collective")
    if not isinstance(name, str):
        raise ddl.DDLConfigError(f"hvd.{fn}: name must be a str, got {name!r}")
    held = st.names.get(name)
    if held is not None and held[0] > st.observed:
        raise ddl.DDLConfigError(
            f"hvd.{fn}: Duplicate name {name!r}: an operation with this name is still in "
            f"flight (hvd.{NAMES.get(held[1], '?')}, call #{held[0]}, not yet synchronized). "
            "As in Horovod, names of in-flight operations must be unique: synchronize the "
            "earlier one first, or use another name"
        )


def _claim(name: str, seq: int, kind: int, st: _State) -> None:
    names = st.names
    if len(names) > 4096:
        observed = st.observed
        for k in [k for k, (s, _) in names.items() if s <= observed]:
            del names[k]
    names[name] = (seq, kind)


def _job(p: Planned, seq: int, st: _State, failure: BaseException | None = None
         ) -> Callable[[], Any]:
    call, data, before, payload = p.call, p.data, p.before, p.payload

    def job():
        outer = getattr(running, "st", None)
        running.st = st  # the exchange and the error path run in the call's process set
        try:
            return _run_job(call, data, before, payload, seq, st, failure)
        finally:
            running.st = outer

    return job


def run_step(call: Call, data: Callable[[np.ndarray], Any], payload: int, word: int,
             st: _State) -> Any:
    """One attempt at a call on the worker: its exchange (folded where it can be), then its
    data. ``Retry`` when a round of named calls met it (it ran nowhere)."""
    engine = engine_for(call, st)
    if engine is not None:
        return run_folded(call, word, payload, data, engine, st)
    return engine_step(data, step(call, word, payload, None))


def _run_job(call: Call, data: Callable[[np.ndarray], Any], before: Callable[[], None] | None,
             payload: int, seq: int, st: _State, failure: BaseException | None) -> Any:
    """One queued call on the worker: ``before``, the exchange (folded where it can be),
    the data; or, after a failure here, the exchange that tells the peers."""
    failed = failure
    if before is not None and failed is None:
        try:
            before()
        except Exception as exc:  # noqa: BLE001 - the peers must hear of any failure
            failed = exc
    while True:  # again after a round of named calls met the step (Retry)
        try:
            if failed is None:
                return run_step(call, data, payload, seq + st.skew, st)
            try:
                step(call, seq + st.skew, payload, failed)
            except Exception:  # noqa: BLE001, S110 - this rank raises its own error below
                pass
            break
        except Retry:
            continue
    if failure is None:
        raise failed  # ``before`` failed: whoever waits for the handle gets it
    return None  # planning failed: the caller has raised it already


def submit(kind: int, name: str | None, plan: Callable[[], Planned], *, async_: bool,
           label: str, scope: _State | None = None) -> Any:
    """Plan a call and queue it with its control step, in process set ``scope`` (the
    global one by default). ``plan`` runs here, on the caller's thread, and whatever it
    raises still takes part in the exchange (marked FAILED) before it propagates. Returns a
    :class:`Handle` when ``async_``, else the finished result."""
    if not ddl.is_initialized():
        raise ddl.DDLError("ddl is not initialized: call hvd.init() first")
    st = scope or global_state()
    with st.lock:
        seq = st.calls
        st.calls += 1
    try:
        if name is not None:
            _check_name(name, kind, st)
        p = plan()
    except Exception as exc:
        _fail(Call(kind, name=name if isinstance(name, str) else None, known=False), seq, exc,
              async_, label, st)
        raise
    if name is not None:
        _claim(name, seq, kind, st)
    job = _job(p, seq, st)
    if async_:
        queued = _api.dispatch(job, label, async_=True, group=st.group, what=p.call)
        return Handle(queued, seq, p.finish, label, st)
    try:
        out = _api.dispatch(job, label, async_=False, group=st.group, what=p.call)
    finally:
        st.epoch += 1  # observe(seq, st)
        if seq > st.observed:
            st.observed = seq
    return p.finish(out) if p.finish is not None else out


def fail_here(kind: int, exc: BaseException, label: str, *, async_: bool,
              scope: _State | None = None) -> None:
    """A call of ``kind`` failed here before it could be planned (``exc``): it takes part
    in the exchange all the same, so the other ranks' call raises too. The caller raises."""
    if ddl.is_initialized():
        st = scope or global_state()
        _fail(Call(kind, known=False), next_seq(st), exc, async_, label, st)


def _fail(call: Call, seq: int, exc: BaseException, async_: bool, label: str,
          st: _State) -> None:
    """Take part in the exchange for a call that failed here; blocking calls wait for it, so
    every rank raises at the same point. Raises nothing."""
    if not ddl.is_initialized():
        return
    job = _job(Planned(call, lambda r: None), seq, st, failure=exc)
    try:
        _api.dispatch(job, label, async_=async_, group=st.group)
    except Exception:  # noqa: BLE001, S110 - the caller raises ``exc``
        pass
    finally:
        if not async_:
            observe(seq, st)

