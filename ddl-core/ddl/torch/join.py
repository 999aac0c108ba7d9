"""Horovod's ``join`` for ``ddl.torch``: a rank that ran out of data keeps serving the others.

In Horovod a coordinator knows which ranks have called ``join()`` and tells them what to
contribute to each collective the others still issue. The ddl core has no coordinator: ranks
run collectives in submission order. So every collective issued through the Horovod API
negotiates for itself. Inside the same queued work as its data (so async ordering is kept),
just before the data moves, every rank takes part in one small allreduce (MAX) of an int64
*descriptor*:

- a running rank sends what it is about to do: ``kind, op, dtype, numel, root/arg, ndim,
  dims, prescale, postscale`` and, in a second block, the same words negated, so the MAX
  gives both the largest and (negated) the smallest value of each word: any difference
  between ranks is seen by every rank at once, and all raise the same clear error;
- a joined rank sends a sentinel (``-2**62``) in every word, so it never wins the MAX, and
  learns from the result what the others do. It then takes part with an empty contribution:
  zeros of the right dtype and shape for allreduce and reduce_scatter (Min, Max and Product
  see those zeros too, and Average still divides by ``size()``: Horovod's rule), no rows for
  allgather and alltoall; what it receives is dropped.
- when every rank sends the sentinel, all have joined: ``join()`` returns on every rank the
  rank that joined last (latest in the collective sequence, then latest in time, then the
  highest rank), agreed through one final allgather.

A broadcast whose root has joined, and ``broadcast_object``/``allgather_object`` while any
rank has joined, raise a ``DDLError`` on every running rank (the joined ranks keep serving).

Cost: one extra allreduce of ``_LEN`` int64 words per Horovod-level collective (a fused
gradient bucket of the DistributedOptimizer is one collective).
"""

from __future__ import annotations

import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import ddl
from ddl import api as _api
from ddl import dtypes as _dtypes
from ddl import tensors as _tensors

# ----------------------------------------------------------------- descriptor layout
KIND, OP, DTYPE, NUMEL, ARG, NDIM = range(6)
DIMS = 6
MAX_DIMS = 8  # shapes of up to this many dimensions travel exactly
PRE = DIMS + MAX_DIMS
POST = PRE + 1
_AGREED = POST + 1  # words every running rank must agree on; the next _AGREED are negated
ROOT_HERE = 2 * _AGREED  # 1 on a running rank that is the root of this broadcast
JOINED = ROOT_HERE + 1  # 1 on a joined rank
LOWEST = ROOT_HERE + 2  # -rank on a running rank: the MAX is minus the lowest running rank
DIM0 = ROOT_HERE + 3  # this rank's own first dimension (allgather/alltoall), for messages
_LEN = ROOT_HERE + 4
SENTINEL = -(1 << 62)

# kinds
ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_SCATTER, ALLTOALL, BARRIER = range(1, 7)
BROADCAST_OBJECT, ALLGATHER_OBJECT, PLAN = range(7, 10)
_NAMES = {
    ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast",
    REDUCE_SCATTER: "reduce_scatter", ALLTOALL: "alltoall", BARRIER: "barrier",
    BROADCAST_OBJECT: "broadcast_object", ALLGATHER_OBJECT: "allgather_object",
    PLAN: "DistributedOptimizer plan broadcast",
}
_REDUCING = (ALLREDUCE, REDUCE_SCATTER)
_ROOTED = (BROADCAST, BROADCAST_OBJECT)
_GATHERING = (ALLGATHER, ALLTOALL)  # the first dimension may differ between ranks
_OBJECTS = (BROADCAST_OBJECT, ALLGATHER_OBJECT)  # need every rank's data: not after join
_SHAPED = (ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_SCATTER, ALLTOALL)


class _State:
    def __init__(self) -> None:
        # Control exchanges done by this process. Every rank does the same ones (the joined
        # ones inside join()), so this is a position in the job's collective sequence.
        self.count = 0
        self.templates: dict[tuple, np.ndarray] = {}
        self.optimizers: list[weakref.ref] = []
        self.lock = threading.Lock()


_state = _State()


def _scale_bits(x: float) -> int:
    """A float as an int64 inside the descriptor's range (loses the 2 lowest bits)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0] >> 2


def _bits_scale(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b) << 2))[0]


def _descriptor(kind: int, op: int = 0, code: int = 0, shape: tuple[int, ...] = (),
                arg: int = 0, pre: float = 1.0, post: float = 1.0) -> np.ndarray:
    """This running rank's descriptor (cached: it is only read, never reduced into)."""
    rank = ddl.rank()
    key = (kind, op, code, shape, arg, pre, post, rank)
    d = _state.templates.get(key)
    if d is not None:
        return d
    words = [0] * _AGREED
    words[KIND], words[OP], words[DTYPE], words[ARG] = kind, int(op), code, int(arg)
    nd = len(shape)
    dims = [int(s) for s in shape]
    if nd > MAX_DIMS:
        dims = dims[: MAX_DIMS - 1] + [int(np.prod(dims[MAX_DIMS - 1:], dtype=np.int64))]
    dim0 = dims[0] if dims else 0
    if kind in _GATHERING and dims:
        dims[0] = 0  # may differ between ranks
    words[NDIM] = nd
    words[DIMS:DIMS + len(dims)] = dims
    words[NUMEL] = 0 if kind in _GATHERING else int(np.prod(shape, dtype=np.int64))
    words[PRE], words[POST] = _scale_bits(pre), _scale_bits(post)
    info = [1 if kind in _ROOTED and arg == rank else 0, 0, -rank, dim0]
    d = np.array(words + [-w for w in words] + info, dtype=np.int64)
    if len(_state.templates) > 4096:
        _state.templates.clear()
    _state.templates[key] = d
    return d


def _joined_descriptor() -> np.ndarray:
    d = np.full(_LEN, SENTINEL, dtype=np.int64)
    d[JOINED] = 1
    return d


def _code(x: Any) -> int:
    if _tensors.is_torch(x):
        return _tensors.dtype_of(x).code
    return _dtypes.from_numpy(np.asarray(x).dtype).code


# ------------------------------------------------------------------- negotiation
def _exchange(mine: np.ndarray) -> np.ndarray:
    """The control allreduce. Runs on the thread that runs the queued work."""
    out = mine.copy()
    _api._plan_allreduce(out, ddl.Max, None, True)()
    _state.count += 1
    return out


def _problem(r: np.ndarray) -> bool:
    """Whether the exchange found something the collective cannot run with. Every rank
    decides from the same ``r``, so all take the error path together."""
    if (r[:_AGREED] + r[_AGREED:2 * _AGREED]).any():  # max != min among running ranks
        return True
    kind = r[KIND]
    if kind in _ROOTED and r[ROOT_HERE] != 1:  # the root has joined
        return True
    # Objects need every rank's data; a joined rank cannot rebuild a shape of > MAX_DIMS.
    return bool(r[JOINED] == 1 and (kind in _OBJECTS or (kind in _SHAPED
                                                         and r[NDIM] > MAX_DIMS)))


def _diagnose(mine: np.ndarray) -> np.ndarray:
    """Every rank's own descriptor (the error path only)."""
    return _api._plan_allgather(mine.reshape(1, _LEN))()


def _negotiate(mine: np.ndarray) -> np.ndarray:
    """A running rank's control step; raises the agreed error."""
    r = _exchange(mine)
    if _problem(r):
        raise _error(_diagnose(mine), r)
    return r


def _describe(row: np.ndarray) -> str:
    kind = int(row[KIND])
    if row[JOINED] == 1 or kind == SENTINEL:
        return "hvd.join() (finished, serving the others)"
    name = _NAMES.get(kind, f"collective #{kind}")
    if kind in (BARRIER,) + _OBJECTS:
        return f"hvd.{name}" + (f"(root_rank={int(row[ARG])})" if kind in _ROOTED else "")
    dt = _dtypes.BY_CODE.get(int(row[DTYPE]))
    nd = int(row[NDIM])
    dims = [int(x) for x in row[DIMS:DIMS + min(nd, MAX_DIMS)]]
    if kind in _GATHERING and dims:
        dims[0] = int(row[DIM0])
    shape = "x".join(map(str, dims)) + ("(folded)" if nd > MAX_DIMS else "")
    parts = [f"{dt.name if dt else '?'}[{shape or 'scalar'}]"]
    if kind in _REDUCING:
        parts.append(f"op={ddl.ReduceOp(int(row[OP])).name.title()}")
    if kind == ALLREDUCE and (row[PRE] != _scale_bits(1.0) or row[POST] != _scale_bits(1.0)):
        parts.append(f"prescale={_bits_scale(row[PRE]):g}, postscale={_bits_scale(row[POST]):g}")
    if kind in _ROOTED:
        parts.append(f"root_rank={int(row[ARG])}")
    return f"hvd.{name}({', '.join(parts)})" if kind != PLAN else f"{name}({parts[0]})"


def _ranks(rs: Sequence[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


def _error(rows: np.ndarray, r: np.ndarray) -> ddl.DDLError:
    me = ddl.rank()
    joined = [i for i, row in enumerate(rows) if row[JOINED] == 1]
    if (r[:_AGREED] + r[_AGREED:2 * _AGREED]).any():
        groups: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(_describe(row), []).append(i)
        lines = "\n".join(f"  {_ranks(rs)}: {d}" for d, rs in groups.items())
        return ddl.DDLMismatchError(
            f"rank {me}: ranks issued different collectives at the same point of their "
            "sequence (every rank must issue the same hvd collectives in the same order, with "
            f"the same dtype, shape, op and root):\n{lines}"
        )
    kind = int(r[KIND])
    if kind in _ROOTED and r[ROOT_HERE] != 1:
        root = int(r[ARG])
        return ddl.DDLError(
            f"rank {me}: hvd.{_NAMES[kind]} from root_rank {root}, but rank {root} has already "
            f"called hvd.join() and has no data to send (joined: {_ranks(joined)}); broadcast "
            "before join, or from a rank that is still running"
        )
    if kind in _OBJECTS:
        return ddl.DDLError(
            f"rank {me}: hvd.{_NAMES[kind]} needs every rank's data, but {_ranks(joined)} "
            "already called hvd.join(); call it before join() or after join() returns"
        )
    return ddl.DDLError(
        f"rank {me}: hvd.{_NAMES.get(kind, kind)} of a tensor with {int(r[NDIM])} dimensions "
        f"cannot be served by joined ranks ({_ranks(joined)}): at most {MAX_DIMS} dimensions "
        "travel in the join descriptor; reshape it first"
    )


def _submit(mine: np.ndarray, data: Callable[[], Any], name: str, async_: bool,
            before: Callable[[], None] | None = None) -> Any:
    """Queue control step + data as one piece of work (keeps the order of async calls);
    ``before`` (e.g. packing a fusion buffer) runs first, on the same thread."""

    def job():
        if before is not None:
            before()
        _negotiate(mine)
        return data()

    return _api._dispatch(job, name, async_)


# ----------------------------------------------------- collectives of running ranks
class Ready:
    """A handle for work already finished on this thread."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def poll(self) -> bool:
        return True

    def wait(self) -> Any:
        return self._value


def submit_allreduce(tensor: Any, op: ddl.ReduceOp, *, name: str, inplace: bool = False,
                     async_: bool = True, prescale: float = 1.0, postscale: float = 1.0,
                     before: Callable[[], None] | None = None,
                     sources: list | None = None) -> Any:
    """Allreduce ``tensor``. With ``sources``, ``tensor`` is the fusion buffer they would
    be packed into, never packed: their sum goes into it, or back into the sources when
    ``inplace`` (ranks that joined see an allreduce of ``tensor`` either way)."""
    if sources is None:
        data = _api._plan_allreduce(tensor, op, None, inplace)
    else:
        data = _api._plan_allreduce_into(sources, None if inplace else tensor, op)
    mine = _descriptor(ALLREDUCE, op, _code(tensor), tuple(tensor.shape), 0, prescale, postscale)
    return _submit(mine, data, name, async_, before)


def submit_reduce_scatter(tensor: Any, op: ddl.ReduceOp, *, name: str,
                          async_: bool = True) -> Any:
    data = _api._plan_reduce_scatter(tensor, op)
    mine = _descriptor(REDUCE_SCATTER, op, _code(tensor), tuple(tensor.shape))
    return _submit(mine, data, name, async_)


def submit_allgather(tensor: Any, *, name: str, async_: bool = True) -> Any:
    data = _api._plan_allgather(tensor)
    mine = _descriptor(ALLGATHER, 0, _code(tensor), tuple(tensor.shape))
    return _submit(mine, data, name, async_)


def submit_broadcast(tensor: Any, root_rank: int, *, name: str, inplace: bool = False,
                     async_: bool = True) -> Any:
    data = _api._plan_broadcast(tensor, root_rank, inplace)
    mine = _descriptor(BROADCAST, 0, _code(tensor), tuple(tensor.shape), root_rank)
    return _submit(mine, data, name, async_)


def run_alltoall(tensor: Any, splits: list[int], *, name: str) -> tuple[np.ndarray, Any]:
    """Both allgathers of ``collectives.alltoall`` behind one control step. Returns the
    splits table (``table[i][j]``: rows rank i sends to rank j) and every rank's rows."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row = int(np.prod(tuple(tensor.shape[1:]), dtype=np.int64)) if tensor.dim() else 1
    table = _api._plan_allgather(np.asarray([splits], dtype=np.int64))
    data = _api._plan_allgather(tensor.reshape(rows, row))
    mine = _descriptor(ALLTOALL, 0, _code(tensor), tuple(tensor.shape))
    return _submit(mine, lambda: (table(), data()), name, False)


def run_barrier() -> None:
    """The control allreduce is itself a barrier over every rank, joined ones included."""
    _submit(_descriptor(BARRIER), lambda: None, "barrier", False)


def check_object_collective(kind_name: str, root_rank: int = 0) -> None:
    """The control step of ``broadcast_object``/``allgather_object`` (which then run as
    several core collectives): raises on every running rank if any rank has joined."""
    kind = BROADCAST_OBJECT if kind_name == "broadcast_object" else ALLGATHER_OBJECT
    _submit(_descriptor(kind, arg=root_rank if kind == BROADCAST_OBJECT else 0), lambda: None,
            kind_name, False)


def register_optimizer(optimizer: Any) -> int:
    """Index of a DistributedOptimizer, the same on every rank when every rank creates its
    optimizers in the same order; a joined rank applies the plans broadcast under it."""
    with _state.lock:
        _state.optimizers.append(weakref.ref(optimizer))
        return len(_state.optimizers) - 1


def broadcast_plan(times: np.ndarray, index: int) -> np.ndarray:
    """Broadcast a DistributedOptimizer's readiness times from the lowest running rank
    (rank 0 unless it has joined); joined ranks adopt the same plan for optimizer ``index``.
    """
    times = np.ascontiguousarray(times, dtype=np.float64)
    mine = _descriptor(PLAN, 0, _code(times), tuple(times.shape), index)

    def job():
        r = _negotiate(mine)
        _api._plan_broadcast(times, int(-r[LOWEST]), True)()
        return times

    return _api._dispatch(job, "DistributedOptimizer.plan", False)


# ------------------------------------------------------------------ joined ranks
def _zeros(code: int, shape: tuple[int, ...]) -> Any:
    dt = _dtypes.BY_CODE[code]
    if dt is _dtypes.BFLOAT16:
        import torch

        return torch.zeros(shape, dtype=torch.bfloat16)
    return np.zeros(shape, dtype=dt.storage)


def _serve(r: np.ndarray) -> None:
    """Take part in the collective the running ranks described, contributing nothing."""
    kind, code = int(r[KIND]), int(r[DTYPE])
    nd = min(int(r[NDIM]), MAX_DIMS)
    shape = tuple(int(x) for x in r[DIMS:DIMS + nd])
    if kind == ALLREDUCE:
        _api._plan_allreduce(_zeros(code, shape), ddl.ReduceOp(int(r[OP])), None, True)()
    elif kind == REDUCE_SCATTER:
        _api._plan_reduce_scatter(_zeros(code, shape), ddl.ReduceOp(int(r[OP])))()
    elif kind == ALLGATHER:
        _api._plan_allgather(_zeros(code, (0,) + shape[1:]))()
    elif kind == ALLTOALL:
        row = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        _api._plan_allgather(np.zeros((1, ddl.size()), dtype=np.int64))()
        _api._plan_allgather(_zeros(code, (0, row)))()
    elif kind == BROADCAST:
        _api._plan_broadcast(_zeros(code, shape), int(r[ARG]), True)()
    elif kind == PLAN:
        times = np.zeros(shape, dtype=np.float64)
        _api._plan_broadcast(times, int(-r[LOWEST]), True)()
        index = int(r[ARG])
        opt = _state.optimizers[index]() if index < len(_state.optimizers) else None
        if opt is not None:
            opt._adopt_plan(times)
    # BARRIER: the control exchange was all of it.


def _serve_until_all_joined() -> int:
    ticket = np.asarray([[_state.count, time.time_ns()]], dtype=np.int64)
    mine = _joined_descriptor()
    while True:
        r = _exchange(mine)
        if r[KIND] == SENTINEL:  # nobody is running any more
            break
        if _problem(r):
            _diagnose(mine)  # the running ranks raise; this one keeps serving
            continue
        _serve(r)
    tickets = _api._plan_allgather(ticket)()
    # Last in the collective sequence, then in time, then the highest rank.
    return max(range(len(tickets)), key=lambda i: (int(tickets[i, 0]), int(tickets[i, 1]), i))


def join(device: int = -1) -> int:
    """Horovod's ``hvd.join`` (see the module docstring). ``device`` is accepted for
    compatibility: a joined rank's zeros live in host memory, where the core works."""
    return _api._dispatch(_serve_until_all_joined, "join", False)
