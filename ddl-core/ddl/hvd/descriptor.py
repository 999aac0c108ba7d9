"""The identity descriptor of a Horovod-level call: its int64 words, what they mean, and
the message every rank raises when the ranks' descriptors disagree (every framework).

Every Horovod-level call starts with one allreduce (MAX) of a descriptor
(:mod:`ddl.hvd.control`); this module is its format, with no state of its own:

- agreed words: what the call is (kind, op, dtype, numel, shape, root or argument, scale
  factors, a per-call sequence number, the name the user gave (a stable hash), the process
  set, and for a grouped call the member count and a hash of every member's dtype, device
  and shape), then the same words negated, so the MAX gives both the largest and (negated)
  the smallest value of each: any difference between ranks is seen by every rank at once;
- info words: whether this rank is the root, has joined (join.py) or failed here, minus its
  rank (so the MAX names the lowest running rank), its own first dimension, a payload
  length (``broadcast_object``), and the words of a round of named calls (named.py).

A joined rank's descriptor, and a round's, hold a sentinel (``-2**62``) in every agreed
word, so they never win the MAX. :func:`problem` says, from the MAX alone, whether the call
can run; :func:`error` turns every rank's descriptor and call line into the error all raise.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

import ddl
from ddl import dtypes as _dtypes
from ddl import tensors as _tensors

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
AGREED = LAYOUT + 1  # words every running rank must agree on; the next AGREED are negated
ROOT_HERE = 2 * AGREED  # 1 on a running rank that is the root of this broadcast
JOINED = ROOT_HERE + 1  # 1 on a joined rank
LOWEST = ROOT_HERE + 2  # -rank on a running rank: the MAX is minus the lowest running rank
DIM0 = ROOT_HERE + 3  # this rank's own first dimension (allgather/alltoall)
FAILED = ROOT_HERE + 4  # 1 on a rank whose call failed before its data moved
PAYLOAD = ROOT_HERE + 5  # the root's payload length (broadcast_object), 0 elsewhere
ROUNDING = ROOT_HERE + 6  # 1 on a rank whose step is a round of named calls (named.py)
PENDING = ROOT_HERE + 7  # 1 on a rank in a round, or at a named call, that holds named calls
NAMED = ROOT_HERE + 8  # 1 on a rank at a named call: differing names make the step a round
LEN = ROOT_HERE + 9
NEG_SEQ = SEQ + AGREED
SENTINEL = -(1 << 62)

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
# (the data step sees a provisional result, see fold.py).
FOLDABLE = (ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_SCATTER, ALLTOALL, GROUPED_ALLREDUCE,
            GROUPED_ALLGATHER, GROUPED_BROADCAST, GROUPED_REDUCE_SCATTER)
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
MEMBER = 3 + MAX_DIMS  # layout words per member: dtype code, device, ndim, dims
JOINED_NOTE = "hvd.join() (finished, serving the others)"
_name_words: dict[str, int] = {}  # name -> its word (cache)


# ----------------------------------------------------------------- call identity
def stable_hash(data: bytes) -> int:
    """62 bits of BLAKE2b: the same on every rank and run (Python's hash() is salted), and
    inside the range where the descriptor's negation trick works."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def name_word(name: str | None) -> int:
    if name is None:
        return 0
    w = _name_words.get(name)
    if w is None:
        if len(_name_words) > 4096:
            _name_words.clear()
        w = _name_words[name] = stable_hash(name.encode("utf-8", "surrogatepass")) | 1
    return w


def fold_shape(shape: Sequence[int]) -> list[int]:
    dims = [int(s) for s in shape]
    if len(dims) > MAX_DIMS:
        dims = dims[: MAX_DIMS - 1] + [int(np.prod(dims[MAX_DIMS - 1:], dtype=np.int64))]
    return dims


def layout(members: Sequence[tuple[int, int, tuple[int, ...]]], gathering: bool) -> bytes:
    """A grouped call's ``(dtype code, device, shape)`` members as int64 rows (the bytes of
    them: ``Call.members()`` reads them back). With ``gathering`` the first dimensions
    (which may differ between ranks) are left out."""
    rows = np.zeros((len(members), MEMBER), dtype=np.int64)
    for i, (code, device, shape) in enumerate(members):
        dims = fold_shape(shape)
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
                and scale_bits(post) == _ONE_BITS):
            return rop
        return ddl.Sum
    return rop


def device_of(x: Any) -> int:
    dev = getattr(x, "device", None)
    if dev is None or dev.type in ("cpu", "meta"):
        return 0
    return 1 + (dev.index or 0)


def scale_bits(x: float) -> int:
    """A float as an int64 inside the descriptor's range (loses the 2 lowest bits)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0] >> 2


def bits_scale(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b) << 2))[0]


_ONE_BITS = scale_bits(1.0)
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
        return np.frombuffer(self.layout, dtype=np.int64).reshape(-1, MEMBER)

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


def build(call: Call, failed: bool, rank: int, global_rank: int) -> np.ndarray:
    """The descriptor of ``call`` on set rank ``rank`` (job rank ``global_rank``), before
    its sequence number and payload are filled in."""
    kind = call.kind
    words = [0] * AGREED
    words[KIND], words[OP], words[ARG] = kind, int(call.op), int(call.arg)
    words[PRE], words[POST] = scale_bits(call.pre), scale_bits(call.post)
    words[NAME], words[COUNT] = name_word(call.name), call.count
    words[LAYOUT] = stable_hash(call.layout) if call.layout else 0
    dim0 = 0
    if kind in GROUPED:
        words[NUMEL], words[NDIM] = call.numel, call.ndim
    else:
        words[DTYPE] = call.code
        dims = fold_shape(call.shape)
        dim0 = dims[0] if dims else 0
        if kind in GATHERING and dims:
            dims[0] = 0  # may differ between ranks
        words[NDIM] = len(call.shape)
        words[DIMS:DIMS + len(dims)] = dims
        if kind not in GATHERING:
            words[NUMEL] = int(np.prod(call.shape, dtype=np.int64))
    # roots are job ranks, as in Horovod (also for a process set)
    root_here = kind in ROOTED and call.arg == global_rank
    named = int(call.name is not None)
    info = [int(root_here), 0, -rank, dim0, int(failed), 0, 0, named, named]
    return np.array(words + [-w for w in words] + info, dtype=np.int64)


def joined_descriptor() -> np.ndarray:
    d = np.full(LEN, SENTINEL, dtype=np.int64)
    d[JOINED] = 1
    return d


def round_descriptor(pending: bool) -> np.ndarray:
    """A round of named calls (named.py): like a joined rank's, it never wins the MAX of a
    word the calls agree on, so the ranks that issued a call still compare theirs; ROUNDING
    tells every rank that no call can run in this step."""
    d = np.full(LEN, SENTINEL, dtype=np.int64)
    d[ROUNDING], d[PENDING] = 1, int(pending)
    return d


def is_round(r: np.ndarray) -> bool:
    """Whether the step whose result is ``r`` is a round: some rank's step was one, or some
    rank was at a named call and the ranks' names differ (a name, or none, at one point of
    the sequence: each named call then waits for its name in the pool)."""
    return r[ROUNDING] == 1 or (r[NAMED] == 1 and r[NAME] != -r[NAME + AGREED])


def problem(r: np.ndarray) -> bool:
    """Whether the exchange found something the call cannot run with. Every rank decides
    from the same ``r``, so all take the error path together."""
    if r[FAILED] == 1 or is_round(r):
        return True
    if (r[:AGREED] + r[AGREED:2 * AGREED]).any():  # max != min among running ranks
        return True
    kind = int(r[KIND])
    if kind in ROOTED and r[ROOT_HERE] != 1:  # the root has joined
        return True
    if r[JOINED] == 1:
        # a joined rank rebuilds an allreduce's shape from the descriptor, which folds the
        # dimensions past MAX_DIMS (a grouped one moves flat buffers: any shape is fine)
        return kind in NOT_WITH_JOIN or (kind == ALLREDUCE and r[NDIM] > MAX_DIMS)
    return False


def error(rows: np.ndarray, notes: list[str], r: np.ndarray,
          ranks: Callable[[Sequence[int]], str]) -> ddl.DDLError:
    """The error every running rank raises for the exchange's result ``r``, from every
    rank's descriptor (``rows``) and call line (``notes``); ``ranks`` names positions of
    the process set as job ranks."""
    me = ddl.rank()
    joined = [i for i, row in enumerate(rows) if row[JOINED] == 1]
    failed = [i for i, row in enumerate(rows) if row[FAILED] == 1]
    seqs = {int(row[SEQ]) for row in rows if row[JOINED] != 1}

    def line(i: int) -> str:
        if i in joined:
            return JOINED_NOTE
        return notes[i] + (f" (call #{int(rows[i][SEQ])})" if len(seqs) > 1 else "")

    groups: dict[str, list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(line(i), []).append(i)
    lines = "\n".join(f"  {ranks(rs)}: {d}" for d, rs in groups.items())
    if failed:
        return ddl.DDLMismatchError(
            f"rank {me}: the call failed on {ranks(failed)} before its data moved, so it "
            f"fails on every rank:\n{lines}"
        )
    if r[NAME] != 0 and r[NAME] == -r[NAME + AGREED]:  # one name, different calls
        return ddl.DDLMismatchError(
            f"rank {me}: ranks submitted different collectives under one name (a name "
            "stands for one call: the same kind, dtype, shape, op and root on every "
            f"rank):\n{lines}"
        )
    if (r[:AGREED] + r[AGREED:2 * AGREED]).any():
        return ddl.DDLMismatchError(
            f"rank {me}: ranks issued different collectives at the same point of their "
            "sequence (every rank must issue the same hvd collectives in the same order, with "
            f"the same dtype, shape, op, root and name):\n{lines}"
        )
    kind = int(r[KIND])
    fn = NAMES.get(kind, str(kind))
    if kind in _HOROVOD_JOIN_TEXT:
        return ddl.DDLError(
            f"rank {me}: hvd.{fn}: {_HOROVOD_JOIN_TEXT[kind]} ({ranks(joined)} already "
            "called hvd.join(); call it before join() or after join() returns)")
    if kind in ROOTED and r[ROOT_HERE] != 1:
        root = int(r[ARG])
        return ddl.DDLError(
            f"rank {me}: hvd.{fn} from root_rank {root}, but rank {root} has already "
            f"called hvd.join() and has no data to send (joined: {ranks(joined)}); broadcast "
            "before join, or from a rank that is still running"
        )
    if kind in OBJECTS:
        return ddl.DDLError(
            f"rank {me}: hvd.{fn} needs every rank's data, but {ranks(joined)} "
            "already called hvd.join(); call it before join() or after join() returns"
        )
    return ddl.DDLError(
        f"rank {me}: hvd.{fn} of a tensor with {int(r[NDIM])} dimensions cannot be served "
        f"by joined ranks ({ranks(joined)}): at most {MAX_DIMS} dimensions travel in the "
        "join descriptor; reshape it first"
    )

