"""A process set's side of the identity protocol, and its control step (every framework).

The ddl core has no coordinator: ranks run collectives in the order they submit them, so a
rank that issued another collective, or one call fewer, would pair its data with the wrong
partner call. So every Horovod-level call is exactly one *negotiated* call, whatever happens
on this rank: inside the same queued work as its data (so async calls keep their order),
before any data moves, every rank takes part in one small allreduce (MAX) of the call's
int64 descriptor (:mod:`ddl.hvd.descriptor`), or the descriptor rides on the data's first
step (:mod:`ddl.hvd.fold`).

A call that fails on this rank before its data moves (an op its dtype lacks, a bad root or
splits, compression, a duplicate name, anything raised while planning) still takes part,
marked FAILED, so that every rank raises together: this rank its own error, the others a
``DDLMismatchError`` naming it. A mismatch or a failure costs two allgathers more (every
rank's descriptor, and a line describing its call) that the message is built from; then
every rank adopts the largest sequence number seen, and the job goes on.

Cost: one allreduce of ``descriptor.LEN`` int64 words per call; a grouped call, or a fused
gradient bucket of the DistributedOptimizer, is one call.

This module holds each process set's state (:class:`_State`: its sequence of calls, its
caches, its pool of named calls), the exchange, and what a running rank does with its
result (:func:`settle`); :mod:`ddl.hvd.negotiate` submits calls through it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import ddl
from ddl import api as _api
from ddl import dtypes as _dtypes
from ddl import timeline as _tl
from ddl.engines.base import identity_fold
from ddl.engines.shm_meta import Fold

from .descriptor import (
    AGREED,
    COUNT,
    GROUPED_ALLREDUCE,
    JOINED,
    KIND,
    LEN,
    LOWEST,
    MEMBER,
    NAMES,
    PAYLOAD,
    SEQ,
    SHUTDOWN,
    Call,
    build,
    error,
    is_round,
    problem,
)

_INT64 = _dtypes.BY_NAME["int64"]


class _State:
    """This process's side of the protocol in one process set (the global one, or a set of
    ``hvd.add_process_set``, whose calls run on its own ``ddl.Group``), for one ``init()``
    generation. Each set has its own sequence of calls, as each has its own queue."""

    def __init__(self, group: Any = None, set_id: int = 0) -> None:
        self.group = group  # the ddl.Group of a process set; None: the whole job
        self.set_id = set_id
        self.calls = 0  # Horovod-level calls issued here, each one exchange
        self.skew = 0  # added to ``calls`` on the wire: what re-synchronising moves
        self.count = 0  # control exchanges done, joined ones included: a job position
        self.separate = 0  # of them, exchanges that took a step of their own
        self.fold_ok: bool | None = None  # whether descriptors may ride on the data (cached)
        self.session: Any = None  # the ddl session fold_engine was found in
        self.fold_engine: Any = None  # see fold.engine_for
        self.observed = -1  # the latest call whose end the program has waited for
        self.names: dict[str, tuple[int, int]] = {}  # user-given name -> (call, kind)
        self.templates: dict[tuple, Any] = {}  # descriptor templates (see template)
        self.folds: dict[Call, tuple[Fold, np.ndarray]] = {}  # see fold.prepared
        self.plans: dict[tuple, Any] = {}  # the adapters' per-signature plans (collectives)
        self.last_call: Call | None = None  # the latest folded call, and its fold: one
        self.last_fold: tuple[Fold, np.ndarray] | None = None  # test of identity, no hash
        self.broken: BaseException | None = None  # the engine failed or a peer shut down
        self.lock = threading.Lock()
        # named calls (named.py): submitted here and not yet run, by name (submission
        # order); every named call whose name is not yet free again; the round queued on
        # the worker and not yet started; whether this rank serves as a joined one
        self.pending: dict[str, Any] = {}
        self.by_word: dict[int, str] = {}
        self.named: dict[str, Any] = {}
        self.round_queued: Any = None
        self.joined = False
        self.tries = 0  # named calls queued on the fast path (named._try)
        self.trying: Any = None  # the one whose step runs now
        self.epoch = 0  # returns of the program from a wait (frees the names of done calls)

    @property
    def rank(self) -> int:
        """This process's rank in the set."""
        return ddl.rank() if self.group is None else self.group.rank

    @property
    def size(self) -> int:
        return ddl.size() if self.group is None else self.group.size

    def global_rank(self, i: int) -> int:
        """The job rank of the set's rank ``i``."""
        return i if self.group is None else self.group.ranks[i]

    def engine(self) -> Any:
        return _api.job_engine() if self.group is None else self.group.engine


_state = _State()
running = threading.local()  # the set whose queued call this thread is running


def current() -> _State:
    return getattr(running, "st", None) or _state


def global_state() -> _State:
    return _state


def reset() -> None:
    """Forget everything of the previous ``init()`` (re-init after ``shutdown()``)."""
    global _state
    _state = _State()


def broken() -> BaseException | None:
    """The failure that left this generation unusable (engine error, a peer shut down)."""
    return _state.broken


def calls_issued() -> int:
    return _state.calls


def separate_exchanges(st: _State | None = None) -> int:
    """Identity exchanges that took a collective (or a step) of their own, not folded."""
    return (st or _state).separate


def next_seq(st: _State | None = None) -> int:
    st = st or _state
    with st.lock:
        seq = st.calls
        st.calls += 1
    return seq


def observe(seq: int, st: _State | None = None) -> None:
    """The program has waited for call ``seq`` (so for every earlier one too: queued work
    finishes in order). Names are freed by this, not by the work finishing, which depends on
    timing and would differ between ranks."""
    st = st or _state
    st.epoch += 1
    if seq > st.observed:
        st.observed = seq


def resync_after_join(next_seqs: Sequence[int]) -> None:
    """After ``join()`` returns everywhere: ranks that served calls while joined did not
    count them; all continue from the largest next sequence number."""
    _state.skew += max(int(s) for s in next_seqs) - (_state.calls + _state.skew)


def next_word() -> int:
    return _state.calls + _state.skew


def count() -> int:
    return _state.count


# ------------------------------------------------------------- the descriptor here
def template(call: Call, failed: bool) -> np.ndarray:
    """This running rank's descriptor of ``call`` before its sequence number and payload
    are filled in (cached: callers copy it)."""
    key = (call, failed)
    st = current()
    d = st.templates.get(key)
    if d is not None:
        return d
    d = build(call, failed, st.rank, st.global_rank(st.rank))
    if len(st.templates) > 4096:
        st.templates.clear()
    st.templates[key] = d
    return d


def mine(call: Call, failed: bool, word: int, payload: int) -> np.ndarray:
    d = template(call, failed).copy()
    d[SEQ], d[SEQ + AGREED], d[PAYLOAD] = word, -word, payload
    return d


class Retry(BaseException):  # noqa: N818 - an outcome, not a failure
    """Some rank's step was a round of named calls: the call of this step did not run on
    any rank; its rank issues it again (after the round's named calls, which may run
    first). A BaseException, so that no handler of the call's own errors takes it."""

    ddl_internal = True  # passed between ddl's layers: never shown to a user (failures)


# What a step that met a round does first, on every rank of the set: named.py registers it
# (it runs the named calls every rank has submitted). negotiate knows nothing of names.
on_round: Callable[[np.ndarray, bool], None] | None = None


def meet_round(r: np.ndarray, shutting: bool = False) -> None:
    """The step's result ``r`` showed a round (``r[ROUNDING] == 1``): take part in it;
    ``shutting``: this rank's step is ``hvd.shutdown()``'s (the peers' named calls that
    wait for this rank then fail, as Horovod's shutdown ends pending operations)."""
    if on_round is None:
        raise ddl.DDLError("a peer runs named calls by name, but ddl.hvd.named is not loaded")
    on_round(r, shutting)


# ------------------------------------------------------------------- the exchange
def engine_step(fn: Callable, *args: Any) -> Any:
    """Run an engine step; an engine failure (a peer died or shut down, a timeout) leaves
    this generation unusable, which ``hvd.init()`` then repairs."""
    try:
        return fn(*args)
    except (ddl.DDLMismatchError, ddl.DDLConfigError):
        raise  # the engine is still in step
    except ddl.DDLError as exc:
        current().broken = exc
        raise


def exchange(d: np.ndarray) -> np.ndarray:
    """The control allreduce, in place on ``d`` (a fresh descriptor). Runs on the thread
    that runs the queued work. It goes straight to the job's engine: the descriptor is a
    small host array of one dtype, so none of the core's planning applies to it."""
    st = current()
    engine = st.engine()
    if engine is None:
        raise ddl.DDLError("ddl is not initialized: call hvd.init() first")
    folding = identity_fold(engine)
    alone = None if folding is None else folding.exchange_identity  # meets folded ones
    if _tl.recorder is None and _tl.torch_profiler() is None:
        if alone is not None:
            engine_step(alone, d)
        else:
            engine_step(engine.allreduce, d, d, _INT64, ddl.Max, d.shape)
    else:
        with _tl.span("negotiate", "negotiate") as sp:
            if alone is not None:
                engine_step(alone, d)
            else:
                engine_step(engine.allreduce, d, d, _INT64, ddl.Max, d.shape)
            sp.args = {"call": NAMES.get(int(d[KIND]), "joined"), "seq": int(d[SEQ])}
    st.count += 1
    st.separate += 1
    return d


def diagnose(desc: np.ndarray, note: str) -> tuple[np.ndarray, list[str]]:
    """Every rank's descriptor and the line describing its call (the error path only)."""
    text = note.encode("utf-8", "replace")[:1500] or b"?"
    row = np.append(desc, len(text)).reshape(1, LEN + 1)
    group = current().group
    rows = engine_step(_api.plan_allgather(row, group))
    data = engine_step(_api.plan_allgather(np.frombuffer(text, dtype=np.uint8).copy(), group))
    notes, at = [], 0
    for n in rows[:, LEN].tolist():
        notes.append(bytes(data[at:at + n]).decode("utf-8", "replace"))
        at += n
    return rows[:, :LEN], notes


def share_layout(r: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """A grouped allreduce while some rank has joined: the lowest running rank broadcasts
    the layout, which the joined ranks serve from (``rows`` None on a joined rank)."""
    buf = (np.zeros((int(r[COUNT]), MEMBER), dtype=np.int64) if rows is None
           else rows.copy())
    engine_step(_api.plan_broadcast(buf, int(-r[LOWEST]), inplace=True, group=current().group))
    return buf


def _note(call: Call, failed: BaseException | None) -> str:
    text = call.describe()
    if failed is not None:
        detail = str(failed).splitlines()[0] if str(failed) else ""
        text += f" failed here: {type(failed).__name__}: {detail[:300]}"
    return text


def step(call: Call, word: int, payload: int, failed: BaseException | None
               ) -> np.ndarray | None:
    """A running rank's control step (``word``: the call's sequence number on the wire).
    Returns the exchange's result; raises the agreed error, or returns None after the error
    path when ``failed`` (the caller raises it)."""
    r = exchange(mine(call, failed is not None, word, payload))  # a fresh copy
    return settle(call, word, payload, failed, r)


def settle(call: Call, word: int, payload: int, failed: BaseException | None,
            r: np.ndarray) -> np.ndarray | None:
    """What a running rank does with the exchange's result ``r``: see :func:`step`."""
    st = current()
    if not problem(r):
        if r[JOINED] == 1 and call.kind == GROUPED_ALLREDUCE:
            share_layout(r, call.members())
        return r
    if is_round(r):
        meet_round(r, call.kind == SHUTDOWN)
        raise Retry
    rows, notes = diagnose(mine(call, failed is not None, word, payload),
                           _note(call, failed))
    if r[SEQ] != -r[SEQ + AGREED]:
        # Ranks are at different points of their sequences (a call that never reached the
        # exchange somewhere): all adopt the largest, so the next calls line up again.
        st.skew += int(r[SEQ]) - word
    me = st.rank
    if any(int(row[KIND]) == SHUTDOWN for i, row in enumerate(rows) if i != me) and (
            call.kind != SHUTDOWN):
        st.broken = ddl.DDLPeerError(f"rank {ddl.rank()}: a peer called hvd.shutdown()")
    if failed is not None:
        return None
    raise error(rows, notes, r, _ranks)


def _ranks(rs: Sequence[int]) -> str:
    """Job ranks, from the positions ``rs`` in the current set."""
    st = current()
    rs = [st.global_rank(i) for i in rs]
    where = "" if st.group is None else f" of process set {st.set_id}"
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs)) + where

