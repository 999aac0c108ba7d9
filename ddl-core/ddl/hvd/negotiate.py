"""The identity exchange every Horovod-level collective starts with (every framework).

The ddl core has no coordinator: ranks run collectives in the order they submit them, so a
rank that issued another collective, or one call fewer, would pair its data with the wrong
partner call. So every Horovod-level call is exactly one *negotiated* call, whatever happens
on this rank. Inside the same queued work as its data (so async calls keep their order),
before any data moves, every rank takes part in one small allreduce (MAX) of an int64
descriptor:

- agreed words: what the call is (kind, op, dtype, numel, shape, root or argument, scale
  factors, a per-call sequence number, the name the user gave (a stable hash), the process
  set, and for a grouped call the member count and a hash of every member's dtype, device
  and shape), then the same words negated, so the MAX gives both the largest and (negated)
  the smallest value of each: any difference between ranks is seen by every rank at once;
- info words: whether this rank is the root, has joined (join.py) or failed here, minus its
  rank (so the MAX names the lowest running rank), its own first dimension, a payload
  length (``broadcast_object``).

A call that fails on this rank before its data moves (an op its dtype lacks, a bad root or
splits, compression, a duplicate name, anything raised while planning) still takes part,
marked FAILED, so that every rank raises together: this rank its own error, the others a
``DDLMismatchError`` naming it. A mismatch or a failure costs two allgathers more (every
rank's descriptor, and a line describing its call) that the message is built from; then
every rank adopts the largest sequence number seen, and the job goes on.

Cost: one allreduce of ``_LEN`` int64 words per call; a grouped call, or a fused gradient
bucket of the DistributedOptimizer, is one call. On the shared-memory engine (a job or a
process set on one host) the descriptor is *folded* into the first synchronisation of the
call's own data collective instead (``ShmEngine.fold_identity``): every rank reads every
descriptor after that step and computes the same MAX; when :func:`problem` holds, or some
rank exchanged its descriptor alone (a joined rank, a call that failed there), no rank
moves data in that step and each gets the MAX back (``Unfolded``), which the path above
then handles exactly as the result of a separate exchange. On the multi-host engine the
descriptor rides on the call's first message across hosts the same way
(engines/identity_round.py), with a small allreduce's data in that message. Calls whose
data step reads the exchange's result before its first collective (``broadcast_object``...),
jobs whose torch tensors may go to a device engine, grids of more than one dimension across
hosts, and calls made while the timeline or the torch profiler records (so the exchange
shows as its own span) keep the separate exchange. A folded call's descriptor is made once
per kind of call (``Fold``, only its sequence number patched per call) and compared as one
view per peer. A set of one rank has no peer to agree with: its calls take the folded path
with nobody to meet (``_SOLO``).
"""

from __future__ import annotations

import hashlib
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

import ddl
from ddl import api as _api
from ddl import dtypes as _dtypes
from ddl import tensors as _tensors
from ddl import timeline as _tl
from ddl.engines.shm_meta import Fold, Unfolded

# ----------------------------------------------------------------- descriptor layout
KIND, OP, DTYPE, NUMEL, ARG, NDIM = range(6)
DIMS = 6
MAX_DIMS = 8  # shapes of up to this many dimensions travel exactly
PRE = DIMS + MAX_DIMS
POST = PRE + 1
SEQ = POST + 1  # the call's number in this rank's sequence of Horovod-level calls
NAME = SEQ + 1  # stable hash of the name the user gave, 0 without one
GROUP = NAME + 1  # the process set (0: the global one, the only one today)
COUNT = GROUP + 1  # members of a grouped call
LAYOUT = COUNT + 1  # stable hash of the members' dtypes, devices and shapes
_AGREED = LAYOUT + 1  # words every running rank must agree on; the next _AGREED are negated
ROOT_HERE = 2 * _AGREED  # 1 on a running rank that is the root of this broadcast
JOINED = ROOT_HERE + 1  # 1 on a joined rank
LOWEST = ROOT_HERE + 2  # -rank on a running rank: the MAX is minus the lowest running rank
DIM0 = ROOT_HERE + 3  # this rank's own first dimension (allgather/alltoall)
FAILED = ROOT_HERE + 4  # 1 on a rank whose call failed before its data moved
PAYLOAD = ROOT_HERE + 5  # the root's payload length (broadcast_object), 0 elsewhere
ROUNDING = ROOT_HERE + 6  # 1 on a rank whose step is a round of named calls (named.py)
PENDING = ROOT_HERE + 7  # 1 on a rank in a round, or at a named call, that holds named calls
NAMED = ROOT_HERE + 8  # 1 on a rank at a named call: differing names make the step a round
_LEN = ROOT_HERE + 9
_NEG_SEQ = SEQ + _AGREED
SENTINEL = -(1 << 62)
_INT64 = _dtypes.BY_NAME["int64"]

# kinds
(ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_SCATTER, ALLTOALL, BARRIER, BROADCAST_OBJECT,
 ALLGATHER_OBJECT, PLAN, GROUPED_ALLREDUCE, GROUPED_ALLGATHER, GROUPED_BROADCAST,
 SHUTDOWN, GROUPED_REDUCE_SCATTER, ADD_PROCESS_SET, REMOVE_PROCESS_SET) = range(1, 17)
NAMES = {
    ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast",
    REDUCE_SCATTER: "reduce_scatter", ALLTOALL: "alltoall", BARRIER: "barrier",
    BROADCAST_OBJECT: "broadcast_object", ALLGATHER_OBJECT: "allgather_object",
    PLAN: "DistributedOptimizer plan broadcast", GROUPED_ALLREDUCE: "grouped_allreduce",
    GROUPED_ALLGATHER: "grouped_allgather", GROUPED_BROADCAST: "broadcast_parameters",
    SHUTDOWN: "shutdown", GROUPED_REDUCE_SCATTER: "grouped_reducescatter",
    ADD_PROCESS_SET: "add_process_set", REMOVE_PROCESS_SET: "remove_process_set",
}
REDUCING = (ALLREDUCE, REDUCE_SCATTER, GROUPED_ALLREDUCE, GROUPED_REDUCE_SCATTER)
ROOTED = (BROADCAST, BROADCAST_OBJECT, GROUPED_BROADCAST)
GATHERING = (ALLGATHER, ALLTOALL)  # the first dimension may differ between ranks
GROUPED = (GROUPED_ALLREDUCE, GROUPED_ALLGATHER, GROUPED_BROADCAST, GROUPED_REDUCE_SCATTER)
# Calls whose data step starts with a collective and reads of the exchange's result only
# JOINED and LOWEST before it: their descriptor can ride on that collective's first step
# (the data step sees a provisional result, see _provisional).
FOLDABLE = (ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_SCATTER, ALLTOALL, GROUPED_ALLREDUCE,
            GROUPED_ALLGATHER, GROUPED_BROADCAST, GROUPED_REDUCE_SCATTER)
_FOLDABLE = frozenset(FOLDABLE)  # the per-call test
OBJECTS = (BROADCAST_OBJECT, ALLGATHER_OBJECT)  # need every rank's data: not after join
# What Horovod's controller refuses while any rank has joined ("Allgather is not supported
# with Join at this time", and so for alltoall, broadcast and reducescatter): every running
# rank raises, the joined ones serve on. Joined ranks serve allreduce, grouped allreduce,
# the optimizer's plan broadcast, barrier and shutdown only.
NOT_WITH_JOIN = frozenset((ALLGATHER, ALLTOALL, BROADCAST, REDUCE_SCATTER, GROUPED_ALLGATHER,
                           GROUPED_BROADCAST, GROUPED_REDUCE_SCATTER) + OBJECTS)
_HOROVOD_JOIN_TEXT = {
    ALLGATHER: "Allgather is not supported with Join at this time. Specify "
               "sparse_to_dense=True if using DistributedOptimizer",
    GROUPED_ALLGATHER: "Allgather is not supported with Join at this time.",
    ALLTOALL: "Alltoall is not supported with Join at this time.",
    BROADCAST: "Broadcast is not supported with Join at this time.",
    GROUPED_BROADCAST: "Broadcast is not supported with Join at this time.",
    REDUCE_SCATTER: "Reducescatter is not supported with Join at this time.",
    GROUPED_REDUCE_SCATTER: "Reducescatter is not supported with Join at this time.",
}
_MEMBER = 3 + MAX_DIMS  # layout words per member: dtype code, device, ndim, dims
_JOINED_NOTE = "hvd.join() (finished, serving the others)"


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
        self.fold_engine: Any = None  # see _fold_engine
        self.observed = -1  # the latest call whose end the program has waited for
        self.names: dict[str, tuple[int, int]] = {}  # user-given name -> (call, kind)
        self.templates: dict[tuple, Any] = {}  # descriptor templates (see _template)
        self.folds: dict[Call, tuple[Fold, np.ndarray]] = {}  # see _prepared_fold
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
_name_words: dict[str, int] = {}
_tls = threading.local()  # the set whose queued call this thread is running


def _st() -> _State:
    return getattr(_tls, "st", None) or _state


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


# ----------------------------------------------------------------- call identity
def stable_hash(data: bytes) -> int:
    """62 bits of BLAKE2b: the same on every rank and run (Python's hash() is salted), and
    inside the range where the descriptor's negation trick works."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def _name_word(name: str | None) -> int:
    if name is None:
        return 0
    w = _name_words.get(name)
    if w is None:
        if len(_name_words) > 4096:
            _name_words.clear()
        w = _name_words[name] = stable_hash(name.encode("utf-8", "surrogatepass")) | 1
    return w


def _fold(shape: Sequence[int]) -> list[int]:
    dims = [int(s) for s in shape]
    if len(dims) > MAX_DIMS:
        dims = dims[: MAX_DIMS - 1] + [int(np.prod(dims[MAX_DIMS - 1:], dtype=np.int64))]
    return dims


def layout(members: Sequence[tuple[int, int, tuple[int, ...]]], gathering: bool) -> bytes:
    """A grouped call's ``(dtype code, device, shape)`` members as int64 rows (the bytes of
    them: ``Call.members()`` reads them back). With ``gathering`` the first dimensions
    (which may differ between ranks) are left out."""
    rows = np.zeros((len(members), _MEMBER), dtype=np.int64)
    for i, (code, device, shape) in enumerate(members):
        dims = _fold(shape)
        if gathering and dims:
            dims[0] = 0
        rows[i, 0], rows[i, 1], rows[i, 2] = code, device, len(shape)
        rows[i, 3:3 + len(dims)] = dims
    return rows.tobytes()


def buckets(rows: np.ndarray) -> list[list[int]]:
    """Members of a grouped allreduce that share one fused allreduce: same dtype and device,
    in order of first appearance (running and joined ranks both cut them from the layout)."""
    by_key: dict[tuple[int, int], list[int]] = {}
    for i in range(rows.shape[0]):
        by_key.setdefault((int(rows[i, 0]), int(rows[i, 1])), []).append(i)
    return list(by_key.values())


def member_shape(rows: np.ndarray, i: int) -> tuple[int, ...]:
    nd = min(int(rows[i, 2]), MAX_DIMS)
    return tuple(int(x) for x in rows[i, 3:3 + nd])


def code_of(x: Any) -> int:
    if _tensors.is_torch(x):
        return _tensors.dtype_of(x).code
    return _dtypes.from_numpy(np.asarray(x).dtype).code


def engine_op(op: int, code: int, size: int, post: float = 1.0) -> ddl.ReduceOp:
    """The op the engines run for a call of ``op`` on dtype ``code`` in a set of ``size``
    ranks with postscale ``post``. Horovod averages by summing and then scaling once by
    ``postscale / size`` (ScaleBuffer: by that factor as a float32 for 16- and 32-bit
    floats, as a double for float64, in float64 and truncated for integers), so Average
    runs as Sum, scaled afterwards (``collectives.reduction``). The engine's own Average
    is kept only where it is that very result, bit for bit: float16, float32, float64
    (and complex) on a power-of-two ``size`` without postscale, where it multiplies the
    sum by ``2**-k`` (every rounding rounds the same real number once). Every rank, joined
    ones too (which read ``post`` from the descriptor, so the test is on its bits), decides
    alike. Any other call runs its own op (bool Average: the engine refuses it)."""
    rop = ddl.ReduceOp(op)
    if rop is ddl.Average:
        dt = _dtypes.BY_CODE.get(code)
        if dt is None or dt.is_bool:
            return rop
        if (code in _EXACT_AVERAGE and size & (size - 1) == 0
                and _scale_bits(post) == _ONE_BITS):
            return rop
        return ddl.Sum
    return rop


def device_of(x: Any) -> int:
    dev = getattr(x, "device", None)
    if dev is None or dev.type in ("cpu", "meta"):
        return 0
    return 1 + (dev.index or 0)


def _scale_bits(x: float) -> int:
    """A float as an int64 inside the descriptor's range (loses the 2 lowest bits)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0] >> 2


def _bits_scale(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b) << 2))[0]


_ONE_BITS = _scale_bits(1.0)
# dtypes whose engine Average over 2**k ranks is Horovod's sum-then-scale exactly (bfloat16
# is not: the engine sums it in float32 and divides before its one rounding)
_EXACT_AVERAGE = frozenset(_dtypes.BY_NAME[n].code for n in (
    "float16", "float32", "float64", "complex64", "complex128") if n in _dtypes.BY_NAME)


class Call(NamedTuple):
    """What one Horovod-level call is: its descriptor and the line that names it. A tuple,
    so that it is cheap to make and is itself the key of the descriptor cache."""

    kind: int
    op: int = 0
    code: int = 0
    shape: tuple[int, ...] = ()
    arg: int = 0
    pre: float = 1.0
    post: float = 1.0
    name: str | None = None
    count: int = 0  # grouped calls: members, their total numel and largest ndim, layout
    numel: int = 0
    ndim: int = 0
    layout: bytes = b""
    known: bool = True  # False: planning failed, only the kind and the name are known

    def members(self) -> np.ndarray:
        """The layout rows of a grouped call (see :func:`layout`)."""
        return np.frombuffer(self.layout, dtype=np.int64).reshape(-1, _MEMBER)

    def describe(self) -> str:
        fn = NAMES.get(self.kind, f"collective #{self.kind}")
        if not self.known:
            return f"hvd.{fn}" + (f"(name={self.name!r})" if self.name is not None else "")
        parts = []
        if self.kind in GROUPED:
            rows = self.members()
            shown = [_tensor_text(int(rows[i, 0]), member_shape(rows, i), int(rows[i, 2]),
                                  self.kind == GROUPED_ALLGATHER)
                     for i in range(min(self.count, 6))]
            more = ", ..." if self.count > 6 else ""
            parts.append(f"{self.count} tensors: {', '.join(shown)}{more}")
        elif self.code:
            parts.append(_tensor_text(self.code, tuple(self.shape), len(self.shape)))
        if self.kind in REDUCING and self.op:
            parts.append(f"op={ddl.ReduceOp(self.op).name.title()}")
        if self.pre != 1.0 or self.post != 1.0:
            parts.append(f"prescale={self.pre:g}, postscale={self.post:g}")
        if self.kind in ROOTED:
            parts.append(f"root_rank={self.arg}")
        if self.name is not None:
            parts.append(f"name={self.name!r}")
        if self.kind == PLAN:
            return f"{fn}({', '.join(parts)})"
        return f"hvd.{fn}({', '.join(parts)})"


def _tensor_text(code: int, shape: tuple[int, ...], ndim: int, gathered: bool = False) -> str:
    dt = _dtypes.BY_CODE.get(code)
    dims = [str(d) for d in shape]
    if gathered and dims:
        dims[0] = "*"
    text = "x".join(dims) + ("(folded)" if ndim > MAX_DIMS else "")
    return f"{dt.name if dt else '?'}[{text or 'scalar'}]"


def _template(call: Call, failed: bool) -> np.ndarray:
    """This running rank's descriptor of ``call`` before its sequence number and payload
    are filled in (cached: callers copy it)."""
    key = (call, failed)
    st = _st()
    d = st.templates.get(key)
    if d is not None:
        return d
    rank = st.rank
    kind = call.kind
    words = [0] * _AGREED
    words[KIND], words[OP], words[ARG] = kind, int(call.op), int(call.arg)
    words[PRE], words[POST] = _scale_bits(call.pre), _scale_bits(call.post)
    words[NAME], words[COUNT] = _name_word(call.name), call.count
    words[LAYOUT] = stable_hash(call.layout) if call.layout else 0
    dim0 = 0
    if kind in GROUPED:
        words[NUMEL], words[NDIM] = call.numel, call.ndim
    else:
        words[DTYPE] = call.code
        dims = _fold(call.shape)
        dim0 = dims[0] if dims else 0
        if kind in GATHERING and dims:
            dims[0] = 0  # may differ between ranks
        words[NDIM] = len(call.shape)
        words[DIMS:DIMS + len(dims)] = dims
        if kind not in GATHERING:
            words[NUMEL] = int(np.prod(call.shape, dtype=np.int64))
    # roots are job ranks, as in Horovod (also for a process set)
    root_here = kind in ROOTED and call.arg == st.global_rank(rank)
    named = int(call.name is not None)
    info = [int(root_here), 0, -rank, dim0, int(failed), 0, 0, named, named]
    d = np.array(words + [-w for w in words] + info, dtype=np.int64)
    if len(st.templates) > 4096:
        st.templates.clear()
    st.templates[key] = d
    return d


def _mine(call: Call, failed: bool, word: int, payload: int) -> np.ndarray:
    d = _template(call, failed).copy()
    d[SEQ], d[SEQ + _AGREED], d[PAYLOAD] = word, -word, payload
    return d


def joined_descriptor() -> np.ndarray:
    d = np.full(_LEN, SENTINEL, dtype=np.int64)
    d[JOINED] = 1
    return d


def round_descriptor(pending: bool) -> np.ndarray:
    """A round of named calls (named.py): like a joined rank's, it never wins the MAX of a
    word the calls agree on, so the ranks that issued a call still compare theirs; ROUNDING
    tells every rank that no call can run in this step."""
    d = np.full(_LEN, SENTINEL, dtype=np.int64)
    d[ROUNDING], d[PENDING] = 1, int(pending)
    return d


class Retry(BaseException):  # noqa: N818 - an outcome, not a failure
    """Some rank's step was a round of named calls: the call of this step did not run on
    any rank; its rank issues it again (after the round's named calls, which may run
    first). A BaseException, so that no handler of the call's own errors takes it."""


# What a step that met a round does first, on every rank of the set: named.py registers it
# (it runs the named calls every rank has submitted). negotiate knows nothing of names.
on_round: Callable[[np.ndarray], None] | None = None


def is_round(r: np.ndarray) -> bool:
    """Whether the step whose result is ``r`` is a round: some rank's step was one, or some
    rank was at a named call and the ranks' names differ (a name, or none, at one point of
    the sequence: each named call then waits for its name in the pool)."""
    return r[ROUNDING] == 1 or (r[NAMED] == 1 and r[NAME] != -r[NAME + _AGREED])


def meet_round(r: np.ndarray) -> None:
    """The step's result ``r`` showed a round (``r[ROUNDING] == 1``): take part in it."""
    if on_round is None:
        raise ddl.DDLError("a peer runs named calls by name, but ddl.hvd.named is not loaded")
    on_round(r)


# ------------------------------------------------------------------- the exchange
def _engine(fn: Callable, *args: Any) -> Any:
    """Run an engine step; an engine failure (a peer died or shut down, a timeout) leaves
    this generation unusable, which ``hvd.init()`` then repairs."""
    try:
        return fn(*args)
    except (ddl.DDLMismatchError, ddl.DDLConfigError):
        raise  # the engine is still in step
    except ddl.DDLError as exc:
        _st().broken = exc
        raise


def exchange(d: np.ndarray) -> np.ndarray:
    """The control allreduce, in place on ``d`` (a fresh descriptor). Runs on the thread
    that runs the queued work. It goes straight to the job's engine: the descriptor is a
    small host array of one dtype, so none of the core's planning applies to it."""
    st = _st()
    engine = st.engine()
    if engine is None:
        raise ddl.DDLError("ddl is not initialized: call hvd.init() first")
    alone = getattr(engine, "exchange_identity", None)  # meets the peers' folded ones
    if _tl.recorder is None and _tl.torch_profiler() is None:
        if alone is not None:
            _engine(alone, d)
        else:
            _engine(engine.allreduce, d, d, _INT64, ddl.Max, d.shape)
    else:
        with _tl.span("negotiate", "negotiate") as sp:
            if alone is not None:
                _engine(alone, d)
            else:
                _engine(engine.allreduce, d, d, _INT64, ddl.Max, d.shape)
            sp.args = {"call": NAMES.get(int(d[KIND]), "joined"), "seq": int(d[SEQ])}
    st.count += 1
    st.separate += 1
    return d


def _may_fold(call: Call, st: _State) -> Any:
    """The engine to fold ``call``'s descriptor into, or None. Ranks may decide differently
    (the engine then runs the exchange as a step of its own): this only has to be safe
    here, which it is when the data step's first collective runs on the set's engine."""
    if call.kind not in _FOLDABLE:
        return None
    if _tl.recorder is not None or _tl.torch_profiler() is not None:
        return None  # traced: the exchange stays a step of its own, with its own span
    engine = st.fold_engine if st.session is _api.session() else _fold_engine(st)
    if engine is None or engine is _SOLO:
        return engine
    # (a process set's calls never go to a device engine)
    unsure = st.group is None and st.fold_ok is not True
    if unsure and (st.fold_ok is False or _device_route(st)):
        return None
    return engine


class _Solo:
    """What a set of one rank folds its descriptor into: with no peer to agree with, the
    identity is settled as soon as it is made, and the data step sees the agreed result."""

    armed = None  # as if the data's first step carried it: nobody else to meet

    @staticmethod
    def fold_identity(fold: Fold) -> None:
        pass

    @staticmethod
    def cancel_fold() -> None:
        return None


_SOLO = _Solo()


def _fold_engine(st: _State) -> Any:
    """The engine that can carry ``st``'s descriptors (``_SOLO`` for a set of one rank),
    or None; cached for the current session (``init()`` makes new engines)."""
    st.session = _api.session()
    engine = st.engine()
    if st.size == 1:
        st.fold_engine = _SOLO
    else:
        st.fold_engine = engine if getattr(engine, "fold_identity", None) else None
    return st.fold_engine


def _device_route(st: _State) -> bool:
    """Whether some torch tensor of this job could go to a device engine (NCCL, or Gloo
    with DDL_DEVICE_ENGINE=gloo) rather than the job's engine. Without torch loaded none
    can, for now: the answer is cached in ``st.fold_ok`` only once it cannot change."""
    s = _api.session()
    router = None if s is None else s.devices
    if router is None:
        return False
    if router.choice == "host":
        st.fold_ok = True
        return False
    if "torch" not in sys.modules:
        return False
    if router.choice == "gloo":
        route = True
    else:
        from ddl.engines import device as _device

        route = _device.available("nccl")
    st.fold_ok = not route
    return route


def _prepared_fold(call: Call, st: _State) -> tuple[Fold, np.ndarray]:
    """The reusable :class:`Fold` of ``call`` in ``st`` (its descriptor as
    :func:`_template`, the sequence number and payload patched per call), and the exchange's
    result as it is whenever the data may move in the folded step: every rank agrees (so
    the agreed words are ours, but for the sequence number, left out), none joined or
    failed, set rank 0 runs and a rooted call's root is here. Made once per kind of call;
    the result is read-only (the data step only reads it)."""
    prepared = st.folds.get(call)
    if prepared is None:
        d = _template(call, False)
        r = d.copy()
        r[JOINED] = r[FAILED] = r[LOWEST] = 0
        r[ROOT_HERE] = int(call.kind in ROOTED)
        r.setflags(write=False)
        # The same agreed words on every folded (so running, not failed) rank: problem()
        # can only hold for a rooted call whose root joined, and a joined rank never folds.
        fold = Fold(d, problem, 0 if call.kind in ROOTED else _AGREED)
        if len(st.folds) > 4096:
            st.folds.clear()
        prepared = st.folds[call] = (fold, r)
    return prepared


def _run_folded(call: Call, word: int, payload: int, data: Callable[[np.ndarray], Any],
                engine: Any, st: _State) -> Any:
    """The call with its descriptor folded into its data's first step (module docstring).
    The fast path makes nothing: a cached fold, three words patched, one engine call."""
    if call is st.last_call:  # the same Call object again (collectives reuses them)
        fold, provisional = st.last_fold
    else:
        fold, provisional = st.last_fold = st.folds.get(call) or _prepared_fold(call, st)
        st.last_call = call
    words = fold.words
    words[SEQ] = word
    words[_NEG_SEQ] = -word
    words[PAYLOAD] = payload
    engine.fold_identity(fold)
    try:
        out = data(provisional)
    except Unfolded as why:
        st.count += 1
        return _engine(data, _settle(call, word, payload, None, why.result))
    except (ddl.DDLMismatchError, ddl.DDLConfigError):
        raise  # the engine is still in step (as _engine)
    except ddl.DDLError as exc:
        st.broken = exc
        raise
    finally:
        left = engine.armed
        if left is not None:
            engine.cancel_fold()
    if left is None:  # the data's first step carried it, and every rank moved its data
        st.count += 1
        return out
    # No collective took it: this rank's data step moved nothing (an empty call); the
    # others meet this exchange in their first step, or run it alone as well.
    _settle(call, word, payload, None, exchange(_mine(call, False, word, payload)))
    return out


def problem(r: np.ndarray) -> bool:
    """Whether the exchange found something the call cannot run with. Every rank decides
    from the same ``r``, so all take the error path together."""
    if r[FAILED] == 1 or is_round(r):
        return True
    if (r[:_AGREED] + r[_AGREED:2 * _AGREED]).any():  # max != min among running ranks
        return True
    kind = int(r[KIND])
    if kind in ROOTED and r[ROOT_HERE] != 1:  # the root has joined
        return True
    if r[JOINED] == 1:
        # a joined rank rebuilds an allreduce's shape from the descriptor, which folds the
        # dimensions past MAX_DIMS (a grouped one moves flat buffers: any shape is fine)
        return kind in NOT_WITH_JOIN or (kind == ALLREDUCE and r[NDIM] > MAX_DIMS)
    return False


def diagnose(mine: np.ndarray, note: str) -> tuple[np.ndarray, list[str]]:
    """Every rank's descriptor and the line describing its call (the error path only)."""
    text = note.encode("utf-8", "replace")[:1500] or b"?"
    row = np.append(mine, len(text)).reshape(1, _LEN + 1)
    group = _st().group
    rows = _engine(_api.plan_allgather(row, group))
    data = _engine(_api.plan_allgather(np.frombuffer(text, dtype=np.uint8).copy(), group))
    notes, at = [], 0
    for n in rows[:, _LEN].tolist():
        notes.append(bytes(data[at:at + n]).decode("utf-8", "replace"))
        at += n
    return rows[:, :_LEN], notes


def share_layout(r: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """A grouped allreduce while some rank has joined: the lowest running rank broadcasts
    the layout, which the joined ranks serve from (``rows`` None on a joined rank)."""
    buf = (np.zeros((int(r[COUNT]), _MEMBER), dtype=np.int64) if rows is None
           else rows.copy())
    _engine(_api.plan_broadcast(buf, int(-r[LOWEST]), True, _st().group))
    return buf


def _note(call: Call, failed: BaseException | None) -> str:
    text = call.describe()
    if failed is not None:
        detail = str(failed).splitlines()[0] if str(failed) else ""
        text += f" failed here: {type(failed).__name__}: {detail[:300]}"
    return text


def _negotiate(call: Call, word: int, payload: int, failed: BaseException | None
               ) -> np.ndarray | None:
    """A running rank's control step (``word``: the call's sequence number on the wire).
    Returns the exchange's result; raises the agreed error, or returns None after the error
    path when ``failed`` (the caller raises it)."""
    r = exchange(_mine(call, failed is not None, word, payload))  # a fresh copy
    return _settle(call, word, payload, failed, r)


def _settle(call: Call, word: int, payload: int, failed: BaseException | None,
            r: np.ndarray) -> np.ndarray | None:
    """What a running rank does with the exchange's result ``r``: see :func:`_negotiate`."""
    st = _st()
    if not problem(r):
        if r[JOINED] == 1 and call.kind == GROUPED_ALLREDUCE:
            share_layout(r, call.members())
        return r
    if is_round(r):
        meet_round(r)
        raise Retry
    rows, notes = diagnose(_mine(call, failed is not None, word, payload),
                           _note(call, failed))
    if r[SEQ] != -r[SEQ + _AGREED]:
        # Ranks are at different points of their sequences (a call that never reached the
        # exchange somewhere): all adopt the largest, so the next calls line up again.
        st.skew += int(r[SEQ]) - word
    me = st.rank
    if any(int(row[KIND]) == SHUTDOWN for i, row in enumerate(rows) if i != me) and (
            call.kind != SHUTDOWN):
        st.broken = ddl.DDLPeerError(f"rank {ddl.rank()}: a peer called hvd.shutdown()")
    if failed is not None:
        return None
    raise error(rows, notes, r)


def _ranks(rs: Sequence[int]) -> str:
    """Job ranks, from the positions ``rs`` in the current set."""
    st = _st()
    rs = [st.global_rank(i) for i in rs]
    where = "" if st.group is None else f" of process set {st.set_id}"
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs)) + where


def error(rows: np.ndarray, notes: list[str], r: np.ndarray) -> ddl.DDLError:
    me = ddl.rank()
    joined = [i for i, row in enumerate(rows) if row[JOINED] == 1]
    failed = [i for i, row in enumerate(rows) if row[FAILED] == 1]
    seqs = {int(row[SEQ]) for row in rows if row[JOINED] != 1}

    def line(i: int) -> str:
        if i in joined:
            return _JOINED_NOTE
        return notes[i] + (f" (call #{int(rows[i][SEQ])})" if len(seqs) > 1 else "")

    groups: dict[str, list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(line(i), []).append(i)
    lines = "\n".join(f"  {_ranks(rs)}: {d}" for d, rs in groups.items())
    if failed:
        return ddl.DDLMismatchError(
            f"rank {me}: the call failed on {_ranks(failed)} before its data moved, so it "
            f"fails on every rank:\n{lines}"
        )
    if r[NAME] != 0 and r[NAME] == -r[NAME + _AGREED]:  # one name, different calls
        return ddl.DDLMismatchError(
            f"rank {me}: ranks submitted different collectives under one name (a name "
            "stands for one call: the same kind, dtype, shape, op and root on every "
            f"rank):\n{lines}"
        )
    if (r[:_AGREED] + r[_AGREED:2 * _AGREED]).any():
        return ddl.DDLMismatchError(
            f"rank {me}: ranks issued different collectives at the same point of their "
            "sequence (every rank must issue the same hvd collectives in the same order, with "
            f"the same dtype, shape, op, root and name):\n{lines}"
        )
    kind = int(r[KIND])
    fn = NAMES.get(kind, str(kind))
    if kind in _HOROVOD_JOIN_TEXT:
        return ddl.DDLError(
            f"rank {me}: hvd.{fn}: {_HOROVOD_JOIN_TEXT[kind]} ({_ranks(joined)} already "
            "called hvd.join(); call it before join() or after join() returns)")
    if kind in ROOTED and r[ROOT_HERE] != 1:
        root = int(r[ARG])
        return ddl.DDLError(
            f"rank {me}: hvd.{fn} from root_rank {root}, but rank {root} has already "
            f"called hvd.join() and has no data to send (joined: {_ranks(joined)}); broadcast "
            "before join, or from a rank that is still running"
        )
    if kind in OBJECTS:
        return ddl.DDLError(
            f"rank {me}: hvd.{fn} needs every rank's data, but {_ranks(joined)} "
            "already called hvd.join(); call it before join() or after join() returns"
        )
    return ddl.DDLError(
        f"rank {me}: hvd.{fn} of a tensor with {int(r[NDIM])} dimensions cannot be served "
        f"by joined ranks ({_ranks(joined)}): at most {MAX_DIMS} dimensions travel in the "
        "join descriptor; reshape it first"
    )


# ------------------------------------------------------------------ submitting
class Planned(NamedTuple):
    """A call ready to queue: its identity, its data step (given the exchange's result),
    what to do with the result on ``wait()``, work to run right before the exchange on the
    worker thread (packing a fusion buffer), and the payload length it announces."""

    call: Call
    data: Callable[[np.ndarray], Any]
    finish: Callable[[Any], Any] | None = None
    before: Callable[[], None] | None = None
    payload: int = 0


class Handle:
    """An ``*_async`` result: ``wait()`` returns it, after any post-processing (scaling,
    decompression, copies); ``poll()`` says whether it is ready. The one handle type of the
    Horovod-level calls, of every framework (``Handle.ready`` wraps a finished result)."""

    __slots__ = ("_inner", "_finish", "_seq", "_done", "_value", "name", "_st")

    def __init__(self, inner: Any, seq: int, finish: Callable[[Any], Any] | None = None,
                 name: str = "", st: _State | None = None) -> None:
        self._inner, self._seq, self._finish, self.name = inner, seq, finish, name
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
        outer = getattr(_tls, "st", None)
        _tls.st = st  # the exchange and the error path run in the call's process set
        try:
            return _run_job(call, data, before, payload, seq, st, failure)
        finally:
            _tls.st = outer

    return job


def run_step(call: Call, data: Callable[[np.ndarray], Any], payload: int, word: int,
             st: _State) -> Any:
    """One attempt at a call on the worker: its exchange (folded where it can be), then its
    data. ``Retry`` when a round of named calls met it (it ran nowhere)."""
    engine = _may_fold(call, st)
    if engine is not None:
        return _run_folded(call, word, payload, data, engine, st)
    return _engine(data, _negotiate(call, word, payload, None))


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
                _negotiate(call, seq + st.skew, payload, failed)
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
    st = scope or _state
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
        return Handle(_api.dispatch(job, label, True, st.group), seq, p.finish, label, st)
    try:
        out = _api.dispatch(job, label, False, st.group)
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
        st = scope or _state
        _fail(Call(kind, known=False), next_seq(st), exc, async_, label, st)


def _fail(call: Call, seq: int, exc: BaseException, async_: bool, label: str,
          st: _State) -> None:
    """Take part in the exchange for a call that failed here; blocking calls wait for it, so
    every rank raises at the same point. Raises nothing."""
    if not ddl.is_initialized():
        return
    job = _job(Planned(call, lambda r: None), seq, st, failure=exc)
    try:
        _api.dispatch(job, label, async_, st.group)
    except Exception:  # noqa: BLE001, S110 - the caller raises ``exc``
        pass
    finally:
        if not async_:
            observe(seq, st)


def resync_after_join(next_seqs: Sequence[int]) -> None:
    """After ``join()`` returns everywhere: ranks that served calls while joined did not
    count them; all continue from the largest next sequence number."""
    _state.skew += max(int(s) for s in next_seqs) - (_state.calls + _state.skew)


def next_word() -> int:
    return _state.calls + _state.skew


def count() -> int:
    return _state.count
