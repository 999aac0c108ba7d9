"""Named calls matched by name, in any order: Horovod's coordinator, without one.

Horovod matches operations by name: each rank may submit its named ``*_async`` calls in
its own order, and a call runs once every rank of its process set has submitted it, in an
order decided once for all ranks. Unnamed calls keep the sequence path of
:mod:`ddl.hvd.negotiate` (the n-th call of every rank is one call), at its cost.

A named call is planned on the caller's thread, then waits in this rank's pool
(``_State.pending``). What moves it is a *round*: a step of the set's sequence, queued on
the worker like any call, whose descriptor (``descriptor.round_descriptor``) never wins an
agreed word, so it can meet anything:

- a round meets rounds, or calls of other ranks: those calls do not run in this step (their
  ranks issue them again: ``control.Retry``); every rank then takes part in the same
  *offer*: one allgather of the names (62-bit hashes) each running rank holds, oldest first;
- the calls every running rank offers run at once, each as an ordinary negotiated call (so a
  call whose dtype, shape or op differ between ranks under one name is a
  ``DDLMismatchError`` on every rank), in the order of the lowest running rank's offer;
  joined ranks offer nothing and serve them as they serve any call (join.py).

A rank queues a round when it submits a named call, and whenever a wait or poll finds its
call not yet run and no round of its own queued; at most one round waits in the queue, and
one that meets nothing to run costs one small step. A call whose ranks have not all
submitted it for ``HOROVOD_STALL_CHECK_TIME_SECONDS`` gets one warning per rank naming the
missing ranks; after ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (0: never) every rank fails
its stalled calls with that list, together (the decision rides on the offer).

Names are unique among calls in flight, as in Horovod: submitting a name whose call has not
run, or has run since the program last returned from a wait, is a local ``ValueError``
(``DDLConfigError``) that nothing else hears of. A call that fails here while it is planned
still waits for its name on every rank, and then fails on every rank together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ddl
from ddl import api as _api
from ddl import runtime as _runtime

from . import control, settings
from . import negotiate as ng
from .descriptor import NAMES, PENDING, Call, name_word, round_descriptor

_log = logging.getLogger("ddl")
OFFER = 64  # names a rank offers per round; older ones first, the others in later rounds
_HEAD = 3  # offer row: [names offered (-1: joined), stall abort, shutting down], the names
# the sequence word of a call run by name: the same on every rank, whatever each has run
_NAMED_WORD = 1 << 50


class _Entry:
    """One named call of this rank, from its submission until its name is free again. A
    blocking call on the fast path has no handle (an ``Event`` costs 2 us): it gets one only
    when it waits in the pool (``_pool``), before any round can see it."""

    __slots__ = ("name", "word", "kind", "planned", "failure", "handle", "label", "since",
                 "warned", "done_epoch", "done", "out", "error")

    def __init__(self, name: str, kind: int, planned: ng.Planned | None,
                 failure: BaseException | None, handle: NamedHandle | None,
                 label: str) -> None:
        self.name, self.word, self.kind, self.label = name, name_word(name), kind, label
        self.planned, self.failure, self.handle = planned, failure, handle
        self.since = time.monotonic()
        self.warned = False
        self.done_epoch = -1
        self.done, self.out, self.error = False, None, None


class NamedHandle(_runtime.QueuedHandle):
    """What ``negotiate.Handle`` waits on for a named call: waiting or polling keeps
    rounds coming while the call has not run, as Horovod's background loop does."""

    __slots__ = ("_st", "trying")

    def __init__(self, name: str, st: control._State) -> None:
        super().__init__(name)
        self._st = st
        self.trying: _runtime.Handle | None = None  # the fast path's job, while queued

    def finished(self) -> bool:
        """Whether the call has run (or failed), without queuing a round."""
        return self._done.is_set()

    def poll(self) -> bool:
        if self._done.is_set():
            return True
        if self.trying is not None and not self.trying.poll():
            return False  # its fast path has not run yet: no round is needed
        ensure_round(self._st)
        return False

    def wait(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0
        if self.trying is not None:
            try:
                self.trying.wait(timeout)
            except BaseException:  # noqa: BLE001, S110 - the call's own error is below
                pass
        while not self._done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ddl.DDLTimeoutError(
                    f"{self.name or 'named call'} did not run within {timeout}s: not every "
                    "rank has submitted it")
            rnd = ensure_round(self._st)
            try:
                rnd.wait(left)
            except ddl.DDLTimeoutError:
                continue
            except BaseException:  # noqa: BLE001, S112 - the round failed every pending call
                continue
            if not self._done.is_set():
                # a round without this call: the others are not there yet
                time.sleep(pause)
                pause = min(0.02, pause * 2 or 1e-4)
        return super().wait(0)


def ensure_round(st: control._State) -> _runtime.Handle:
    """A round of this rank queued on the set's worker (one already queued and not yet
    started is enough: it offers whatever is pending when it runs)."""
    with st.lock:
        rnd = st.round_queued
        if rnd is None:
            rnd = st.round_queued = _api.dispatch(lambda: _run_round(st), "named round",
                                                  async_=True, group=st.group)
        return rnd


def _run_round(st: control._State) -> None:
    with st.lock:
        st.round_queued = None  # calls submitted from now on need another round
        if not st.pending:
            # Nothing of this rank's left to offer (the offer of an earlier step ran it): no
            # call can be ready without this rank, and whatever another rank's round waits
            # for, its next step meets it as well.
            return
    outer = getattr(control.running, "st", None)
    control.running.st = st
    try:
        r = control.exchange(round_descriptor(bool(st.pending)))
        control.meet_round(r)
    except BaseException as exc:
        _fail_all(st, exc)
        raise
    finally:
        control.running.st = outer


def _offer(r: np.ndarray, shutting: bool = False) -> None:
    """A step met a round (``control.on_round``): every rank of the set is here.
    ``shutting``: this rank's step is ``hvd.shutdown()``'s; then every rank's named calls
    that cannot run now fail (Horovod's shutdown ends the pending operations), so that
    nobody waits for a rank that is leaving."""
    st = control.current()
    tried = st.trying
    if tried is not None:  # this rank's named call met other names: it waits in the pool
        st.trying = None
        _pool(st, tried)
    if r[PENDING] != 1:
        return  # no rank in the round holds a named call
    entries = list(st.pending.values())[:OFFER]
    row = np.zeros((1, _HEAD + OFFER), dtype=np.int64)
    row[0, 0] = -1 if st.joined else len(entries)
    row[0, 1] = int(_stall_abort(entries))
    row[0, 2] = int(shutting)
    row[0, _HEAD:_HEAD + len(entries)] = [e.word for e in entries]
    rows = control.engine_step(_api.plan_allgather(row, st.group))
    live = [i for i in range(rows.shape[0]) if rows[i, 0] >= 0]
    offers = [rows[i, _HEAD:_HEAD + rows[i, 0]].tolist() for i in live]
    held = [set(o) for o in offers]
    if rows[:, 1].any():
        _abort_stalled(st, held, live)
        return
    if not offers or st.joined:
        return  # a joined rank serves the calls below as they come (join.py)
    ready = [w for w in offers[0] if all(w in h for h in held[1:])]
    leaving = [st.global_rank(i) for i in range(rows.shape[0]) if rows[i, 2]]
    if not leaving:
        _check_stalls(st, held, live, set(ready))
    for w in ready:
        _execute(st, st.pending.pop(st.by_word.pop(w)))
    if leaving:
        _fail_all(st, ddl.DDLPeerError(
            f"rank {ddl.rank()}: rank(s) {','.join(map(str, leaving))} called hvd.shutdown() "
            "while this named call waited for them (Horovod's shutdown ends pending "
            "operations)"))


def _pool(st: control._State, e: _Entry) -> None:
    if e.handle is None:
        e.handle = NamedHandle(e.label, st)
    if e.word in st.by_word:  # two names with one 62-bit hash: never in practice
        raise ddl.DDLConfigError(f"hvd: the names {e.name!r} and {st.by_word[e.word]!r} "
                                 "have the same hash; rename one")
    st.pending[e.name] = e
    st.by_word[e.word] = e.name


def _try(st: control._State, e: _Entry) -> None:
    """The fast path of a named call (on the worker): the next step of the sequence, with
    its name. If some rank is elsewhere (another name, an unnamed call, a round), the step
    is a round for every rank and the call waits in the pool (``_offer``)."""
    outer = getattr(control.running, "st", None)
    control.running.st = st
    st.trying = e
    p = e.planned
    try:
        if p.before is not None:
            try:
                p.before()
            except Exception as exc:  # noqa: BLE001 - fails on every rank once matched
                e.failure = exc
                raise control.Retry from None
        out = ng.run_step(p.call, p.data, p.payload, _NAMED_WORD, st)
    except control.Retry:
        if st.trying is e:  # (_offer pooled it unless the step never reached it)
            st.trying = None
            _pool(st, e)
        return
    except BaseException as exc:
        st.trying = None
        _finish(st, e, None, exc)
        if isinstance(exc, (ddl.DDLMismatchError, ddl.DDLConfigError)):
            return  # the engine is still in step
        _fail_all(st, exc)
        raise
    finally:
        with st.lock:
            st.tries -= 1
        control.running.st = outer
    st.trying = None
    _finish(st, e, out, None)


def _execute(st: control._State, e: _Entry) -> None:
    """Run a named call every rank offered: its negotiated step, then its data."""
    p = e.planned
    call = p.call if p is not None else Call(e.kind, name=e.name, known=False)
    payload = p.payload if p is not None else 0
    failed = e.failure
    if failed is None and p.before is not None:
        try:
            p.before()
        except Exception as exc:  # noqa: BLE001 - the peers must hear of any failure
            failed = exc
    try:
        if failed is None:  # folded into the data's first step where it can be
            out = ng.run_step(call, p.data, payload, _NAMED_WORD, st)
        else:
            d = control.mine(call, True, _NAMED_WORD, payload)
            control.settle(call, _NAMED_WORD, payload, failed, control.exchange(d))
            out = None
    except control.Retry:
        # every running rank is here, in the same list of calls: no round can meet it
        exc = ddl.DDLError(f"rank {ddl.rank()}: a round met the named call {e.name!r}")
        _finish(st, e, None, exc)
        raise exc from None
    except (ddl.DDLMismatchError, ddl.DDLConfigError) as exc:
        _finish(st, e, None, failed or exc)  # the engine is still in step: go on
        return
    except BaseException as exc:
        _finish(st, e, None, exc)
        raise
    _finish(st, e, out, failed)


def _finish(st: control._State, e: _Entry, out: Any, error: BaseException | None) -> None:
    e.done_epoch = st.epoch
    e.out, e.error, e.done = out, error, True
    if e.handle is not None:
        e.handle._finish(out, error)


def _fail_all(st: control._State, exc: BaseException) -> None:
    """The engine failed in a round: every call still pending here fails with it."""
    with st.lock:
        entries = list(st.pending.values())
        st.pending.clear()
        st.by_word.clear()
    for e in entries:
        _finish(st, e, None, exc)


# ----------------------------------------------------------------------- stalls
def _missing(st: control._State, e: _Entry, held: list[set], live: list[int]) -> list[int]:
    return [st.global_rank(i) for i, h in zip(live, held) if e.word not in h]


def _check_stalls(st: control._State, held: list[set], live: list[int], ready: set) -> None:
    limit = settings.stall_check_s()
    if limit is None:
        return
    now = time.monotonic()
    for e in st.pending.values():
        if e.word in ready or e.warned or now - e.since < limit:
            continue
        e.warned = True
        _log.warning(
            "rank %d: %s was submitted here %.0f s ago and still waits for ranks %s, which "
            "have not submitted it (Horovod's stall check; HOROVOD_STALL_CHECK_TIME_SECONDS "
            "sets the time)", ddl.rank(), _describe(e), now - e.since,
            ",".join(map(str, _missing(st, e, held, live))))


def _stall_abort(entries: list[_Entry]) -> bool:
    limit = settings.stall_shutdown_s()
    if not limit:
        return False
    now = time.monotonic()
    return any(now - e.since >= limit for e in entries)


def _abort_stalled(st: control._State, held: list[set], live: list[int]) -> None:
    """Some rank's stall passed HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: every rank fails each
    call it holds that some running rank has not submitted (the same rows everywhere)."""
    everyone = set.intersection(*held) if held else set()
    for e in [e for e in st.pending.values() if e.word not in everyone]:
        del st.pending[e.name]
        st.by_word.pop(e.word, None)
        _finish(st, e, None, ddl.DDLError(
            f"rank {ddl.rank()}: {_describe(e)} stalled: ranks "
            f"{','.join(map(str, _missing(st, e, held, live)))} never submitted it "
            "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)"))


def _describe(e: _Entry) -> str:
    if e.planned is not None:
        return e.planned.call.describe()
    return f"hvd.{NAMES.get(e.kind, 'collective')}(name={e.name!r})"


# ------------------------------------------------------------------- submitting
def _check_free(name: Any, kind: int, st: control._State) -> None:
    fn = NAMES.get(kind, "collective")
    if not isinstance(name, str):
        raise ddl.DDLConfigError(f"hvd.{fn}: name must be a str, got {name!r}")
    e = st.named.get(name)
    if e is None:
        return
    if e.done and e.done_epoch != st.epoch:
        del st.named[name]
        return
    raise ddl.DDLConfigError(
        f"hvd.{fn}: Duplicate name {name!r}: an operation with this name is still in flight "
        f"({_describe(e)}). As in Horovod, names of in-flight operations must be unique: "
        "synchronize the earlier one first, or use another name"
    )


def submit(kind: int, name: str | None, plan: Callable[[], ng.Planned], *, async_: bool,
           label: str, scope: control._State | None = None) -> Any:
    """``negotiate.submit``, with calls that have a name matched by name (module
    docstring). Returns a ``negotiate.Handle`` when ``async_``, else the result."""
    if name is None:
        return ng.submit(kind, None, plan, async_=async_, label=label, scope=scope)
    if not ddl.is_initialized():
        raise ddl.DDLError("ddl is not initialized: call hvd.init() first")
    st = scope or control.global_state()
    _check_free(name, kind, st)
    # An async call needs its handle now; a blocking one only if it has to wait (_pool).
    inner = NamedHandle(label, st) if async_ else None
    try:
        planned, failure = plan(), None
    except Exception as exc:  # noqa: BLE001 - raised below, and on every rank once matched
        planned, failure = None, exc
    e = _Entry(name, kind, planned, failure, inner, label)
    with st.lock:
        if len(st.named) > 4096:
            for k in [k for k, v in st.named.items() if v.done]:
                del st.named[k]
        st.named[name] = e
        # The fast path, when nothing named is in flight here: the call takes the next
        # point of the sequence with its name; where every rank is at it, it runs at once.
        tries = failure is None and not st.pending and st.round_queued is None and (
            st.tries == 0)
        if tries:
            st.tries += 1
    if tries:
        try:
            job = _api.dispatch(lambda: _try(st, e), label, async_=async_, group=st.group)
        except BaseException:
            if not e.done:  # the job was never queued
                with st.lock:
                    st.tries -= 1
            raise
        if async_:
            inner.trying = job
        elif e.done:  # it ran: the common case, with no handle to make or wait on
            control.observe(-1, st)
            if e.error is not None:
                raise e.error
            return planned.finish(e.out) if planned.finish is not None else e.out
    else:
        with st.lock:
            _pool(st, e)
        ensure_round(st)
    inner = e.handle  # made by _pool if this blocking call waits there
    if failure is not None:
        if not async_:  # a blocking call raises once it failed on every rank, together
            try:
                inner.wait()
            except BaseException:  # noqa: BLE001, S110 - this rank raises its own error
                pass
            control.observe(-1, st)
        raise failure
    handle = ng.Handle(inner, -1, planned.finish, label, st)
    return handle if async_ else handle.wait()


control.on_round = _offer
