"""Horovod's collectives, once, for every framework adapter.

Each collective has one implementation: a *plan* (check the arguments, compress, build the
core's data step and the call's identity) handed to :func:`ddl.hvd.negotiate.submit`, which
queues the data behind the call's identity exchange. Whatever a plan raises still takes
part in that exchange, so an error on one rank is an error on every rank, and two different
calls never pair. The arrays may be numpy arrays or torch tensors (:mod:`ddl.hvd.arrays`);
``ddl.torch`` adds autograd and Horovod's signatures on top, ``ddl.tensorflow`` the
conversion from TensorFlow tensors and the gradients.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

import ddl
from ddl import api as _api
from ddl import tensors as _tensors
from ddl.ops import parse_op

from . import adasum as _adasum
from . import negotiate as ng
from .arrays import NumpyOps, ops_for
from .compression import Compressor, NoneCompressor, passthrough
from .named import submit
from .negotiate import Call, Planned, code_of
from .process_sets import ProcessSet, global_process_set, scope


# ------------------------------------------------------------------- arguments
def check_process_set(process_set: Any) -> ng._State:
    """The process set's protocol state (see :mod:`ddl.hvd.process_sets`)."""
    return scope(process_set)


def resolve_op(average: bool | None, op: Any) -> ddl.ReduceOp:
    """Horovod's ``op=`` / deprecated ``average=`` pair; Average when neither is given."""
    if average is not None:
        if op is not None:
            raise ddl.DDLConfigError("pass op or average (deprecated), not both")
        return ddl.Average if average else ddl.Sum
    if op is None:
        return ddl.Average
    if _adasum.is_adasum(op):
        raise ddl.DDLConfigError(
            "op=hvd.Adasum is for allreduce, grouped_allreduce and DistributedOptimizer "
            "only (as in Horovod); use op=hvd.Average or hvd.Sum here")
    return parse_op(op)


def check_root(root_rank: Any, st: ng._State | None = None) -> tuple[int, int]:
    """``root_rank`` (a job rank, as in Horovod) and its rank in the process set."""
    root = operator.index(root_rank)
    if not 0 <= root < ddl.size():
        raise ddl.DDLConfigError(f"root_rank {root} is outside 0..{ddl.size() - 1}")
    if st is None or st.group is None:
        return root, root
    if root not in st.group.ranks:
        raise ddl.DDLConfigError(
            f"root_rank {root} is not in process set {st.set_id} (ranks "
            f"{list(st.group.ranks)})")
    return root, st.group.ranks.index(root)


def _no_r(step: Callable[[], Any]) -> Callable[[np.ndarray], Any]:
    return lambda r: step()


def reduction(rop: ddl.ReduceOp, t: Any, post: float, size: int) -> tuple[ddl.ReduceOp, float]:
    """The op the engine runs and the factor the result is scaled by after it, once.
    Horovod averages by summing and multiplying by ``postscale / size`` (a double, used as a
    float32 for 16- and 32-bit floats, see ``NumpyOps.scaled``): so does every Average
    here, but where the engine's own Average is that result bit for bit
    (:func:`ddl.hvd.negotiate.engine_op`). An integer average truncates toward zero, as in
    Horovod."""
    engine_op = ng.engine_op(rop, code_of(t), size, post)
    if engine_op is not rop:
        return engine_op, post / size
    return rop, post


def _members(fw: Any, ts: Sequence[Any], gathering: bool) -> bytes:
    return ng.layout([(code_of(t), fw.device(t), tuple(t.shape)) for t in ts],
                     gathering=gathering)


def _ops_of(ts: Sequence[Any]) -> Any:
    return ops_for(ts[0]) if len(ts) else NumpyOps


# ------------------------------------------------------------------- allreduce
def allreduce(tensor: Any, *, average: bool | None = None, name: str | None = None,
              op: Any = None, prescale: float = 1.0, postscale: float = 1.0,
              compression: type[Compressor] = NoneCompressor, inplace: bool = False,
              process_set: Any = None, async_: bool = False) -> Any:
    """The one allreduce. Blocking calls run on the caller's thread when nothing is queued,
    like the core's: no hand-off to the worker thread."""
    st = scope(process_set)
    if op is not None and op.__class__ is not ddl.ReduceOp and _adasum.is_adasum(op):
        return submit(ng.ALLREDUCE, name,
                      lambda: _adasum_plan([tensor], True, average, name, prescale, postscale,
                                           compression, inplace, st),
                      async_=async_, label=name or "allreduce", scope=st)

    def plan() -> Planned:
        if compression is NoneCompressor:
            return _plan_plain_allreduce(tensor, average, name, op, prescale, postscale,
                                         inplace, st)
        return _plan_allreduce(tensor, average, name, op, prescale, postscale, compression,
                               inplace, st)

    return submit(ng.ALLREDUCE, name, plan, async_=async_, label=name or "allreduce",
                  scope=st)


class _Reduce(NamedTuple):
    """What an uncompressed allreduce of one kind of tensor (type, dtype, shape) with one
    set of arguments does, worked out once (``_plan_plain_allreduce``): the ops, the
    scales, the call's identity (the same object every time: negotiate's caches are keyed
    on it) and the tensor operations."""

    rop: ddl.ReduceOp
    engine_op: ddl.ReduceOp
    scale: float  # applied after the engine's reduction (Horovod's integer average)
    pre: float
    call: Call
    fw: Any


def _plan_plain_allreduce(tensor: Any, average: bool | None, name: str | None, op: Any,
                          prescale: float, postscale: float, inplace: bool, st: ng._State
                          ) -> Planned:
    """``allreduce`` without compression, its argument checks and identity cached by
    signature: per call what is left is the core's own plan and this cache's lookup."""
    try:
        key = (tensor.__class__, tensor.dtype, tuple(tensor.shape), op, average, prescale,
               postscale, name)
        sig = st.plans.get(key)
    except (AttributeError, TypeError):  # not an array, an unhashable argument: no cache
        return _plan_allreduce(tensor, average, name, op, prescale, postscale, NoneCompressor,
                               inplace, st)
    if sig is None:
        fw = ops_for(tensor)
        rop = resolve_op(average, op)
        pre, post = float(prescale), float(postscale)
        sent = fw.scaled(tensor, pre) if pre != 1.0 else tensor
        engine_op, scale = reduction(rop, sent, post, st.size)
        call = Call(ng.ALLREDUCE, rop, code_of(sent), tuple(sent.shape), pre=pre, post=post,
                    name=name)
        sig = _Reduce(rop, engine_op, scale, pre, call, fw)
        if len(st.plans) > 4096:
            st.plans.clear()
        st.plans[key] = sig
    scale, fw = sig.scale, sig.fw
    sent = tensor if sig.pre == 1.0 else fw.scaled(tensor, sig.pre)
    # In place whenever the tensor sent is ours to overwrite (see _plan_allreduce)
    data = _api.plan_allreduce(sent, sig.engine_op, inplace=inplace or sent is not tensor,
                               group=st.group)
    if scale == 1.0 and (sent is tensor or not inplace):
        return Planned(sig.call, _no_r(data))  # the engine's result is the answer

    def finish(out: Any) -> Any:
        if scale != 1.0:
            fw.scale_(out, scale)
        if inplace:
            if out is not tensor:
                fw.copy_(tensor, out)
            return tensor
        return out

    return Planned(sig.call, _no_r(data), finish)


def _plan_allreduce(tensor: Any, average: bool | None, name: str | None, op: Any,
                    prescale: float, postscale: float, compression: type[Compressor],
                    inplace: bool, st: ng._State) -> Planned:
    """``allreduce`` with any compression, planned afresh on every call."""
    fw = ops_for(tensor)
    rop = resolve_op(average, op)
    pre, post = float(prescale), float(postscale)
    sent, ctx = compression.compress(tensor)
    if pre != 1.0:
        sent = fw.scaled(sent, pre)
    engine_op, scale = reduction(rop, sent, post, st.size)
    # In place whenever the tensor sent is ours to overwrite: the caller's own for the
    # in-place spellings, or a temporary made by compression or prescaling. Out of place
    # would allocate a fresh result (page faults on every call for large tensors).
    data = _api.plan_allreduce(sent, engine_op, inplace=inplace or sent is not tensor,
                               group=st.group)
    call = Call(ng.ALLREDUCE, rop, code_of(sent), tuple(sent.shape), pre=pre, post=post,
                name=name)

    def finish(out: Any) -> Any:
        if scale != 1.0:
            fw.scale_(out, scale)
        out = compression.decompress(out, ctx)
        if inplace:
            if out is not tensor:
                fw.copy_(tensor, out)
            return tensor
        return out

    return Planned(call, _no_r(data), finish)


def submit_allreduce(tensor: Any, op: ddl.ReduceOp, *, name: str, inplace: bool = False,
                     async_: bool = True, prescale: float = 1.0, postscale: float = 1.0,
                     before: Callable[[], None] | None = None,
                     sources: list | None = None, scope: ng._State | None = None) -> Any:
    """A DistributedOptimizer's bucket allreduce (already packed, scaled by the caller).
    With ``sources``, ``tensor`` is the fusion buffer they would be packed into, never
    packed: their sum goes into it, or back into the sources when ``inplace`` (ranks that
    joined see an allreduce of ``tensor`` either way). ``name`` labels the handle only.
    ``scope``: the process set it runs in (the global one by default; an Average divides
    by the set's size)."""
    group = None if scope is None else scope.group
    size = ddl.size() if scope is None else scope.size

    def plan() -> Planned:
        # The op every rank runs, joined ones too (they serve it from the descriptor): an
        # Average may run as a Sum, then scaled by 1 / size here (the caller applies its
        # postscale itself)
        engine_op = ng.engine_op(op, code_of(tensor), size, postscale)
        if sources is None:
            data = _api.plan_allreduce(tensor, engine_op, inplace=inplace, group=group)
        else:
            data = _api.plan_allreduce_into(sources, None if inplace else tensor, engine_op,
                                            group)
        call = Call(ng.ALLREDUCE, op, code_of(tensor), tuple(tensor.shape), pre=prescale,
                    post=postscale)
        if engine_op == op:
            return Planned(call, _no_r(data), before=before)
        factor = 1.0 / size
        fw = ops_for(tensor)

        def finish(out: Any) -> Any:
            with fw.no_grad():
                if sources is None:
                    fw.scale_(out, factor)
                elif inplace:
                    for t in sources:
                        fw.scale_(t, factor)
                else:
                    fw.scale_(tensor, factor)
            return out

        return Planned(call, _no_r(data), finish, before=before)

    return submit(ng.ALLREDUCE, None, plan, async_=async_, label=name, scope=scope)


def grouped_allreduce(tensors: Sequence[Any], *, average: bool | None = None,
                      name: str | None = None, op: Any = None, prescale: float = 1.0,
                      postscale: float = 1.0, compression: type[Compressor] = NoneCompressor,
                      inplace: bool = False, process_set: Any = None,
                      async_: bool = False) -> Any:
    """One call, whose descriptor covers every member: one fused allreduce per (dtype,
    device), all in the same queued work (Horovod's grouped_allreduce fuses too)."""

    st = scope(process_set)
    if _adasum.is_adasum(op):
        return submit(ng.GROUPED_ALLREDUCE, name,
                      lambda: _adasum_plan(list(tensors), False, average, name, prescale,
                                           postscale, compression, inplace, st),
                      async_=async_, label=name or "grouped_allreduce", scope=st)

    def plan() -> Planned:
        rop = resolve_op(average, op)
        pre, post = float(prescale), float(postscale)
        ts = list(tensors)
        fw = _ops_of(ts)
        sent = [compression.compress(t) for t in ts]
        call = Call(ng.GROUPED_ALLREDUCE, rop, pre=pre, post=post, name=name, count=len(ts),
                    numel=sum(fw.numel(s) for s, _ in sent),
                    ndim=max((fw.ndim(s) for s, _ in sent), default=0),
                    layout=_members(fw, [s for s, _ in sent], False))
        rows = call.members()
        direct = inplace and passthrough(compression) and pre == 1.0
        parts: list[tuple[list[int], Any, Callable[[], Any], float]] = []
        with fw.no_grad():
            for idx in ng.buckets(rows):
                engine_op, scale = reduction(rop, sent[idx[0]][0], post, st.size)
                if direct and rows[idx[0], 1] == 0:
                    # Host tensors reduced where they live, as one fused collective: nothing
                    # is packed
                    group = [ts[i] for i in idx]
                    parts.append((idx, None,
                                  _api.plan_allreduce_into(group, None, engine_op, st.group),
                                  scale))
                    continue
                flat = fw.flat_cat([sent[i][0] for i in idx])
                if pre != 1.0:
                    fw.scale_(flat, pre)
                parts.append((idx, flat,
                              _api.plan_allreduce(flat, engine_op, inplace=True, group=st.group),
                              scale))

        def finish(_: Any) -> list[Any]:
            out: list[Any] = [None] * len(ts)
            with fw.no_grad():
                for idx, flat, _step, scale in parts:
                    if flat is None:  # reduced in place, where the tensors live
                        for i in idx:
                            if scale != 1.0:
                                fw.scale_(ts[i], scale)
                            out[i] = ts[i]
                        continue
                    if scale != 1.0:
                        fw.scale_(flat, scale)
                    off = 0
                    for i in idx:
                        s, ctx = sent[i]
                        n = fw.numel(s)
                        r = compression.decompress(fw.reshape(flat[off:off + n], s.shape), ctx)
                        off += n
                        if inplace:
                            fw.copy_(ts[i], r)
                            r = ts[i]
                        out[i] = r
            return out

        return Planned(call, lambda r: [step() for _, _, step, _ in parts], finish)

    return submit(ng.GROUPED_ALLREDUCE, name, plan, async_=async_,
                  label=name or "grouped_allreduce", scope=st)


# ---------------------------------------------------------------------- adasum
class _AdasumCall(Call):
    """An Adasum call's identity: an allreduce whose op word is ``ADASUM_CODE``, which
    ``ddl.ReduceOp`` (and so ``Call.describe``) does not know."""

    __slots__ = ()

    def describe(self) -> str:
        return Call(*self._replace(op=int(ddl.Sum))).describe().replace("op=Sum", "op=Adasum")


def _adasum_plan(ts: list[Any], single: bool, average: bool | None, name: str | None,
                 prescale: float, postscale: float, compression: type[Compressor],
                 inplace: bool, st: ng._State) -> Planned:
    """Adasum (:mod:`ddl.hvd.adasum`) of one tensor or a group: prescaled and compressed as
    a Sum would be, one allgather of each dtype's members, the tree evaluated here, then
    postscaled. Coefficients are per member."""
    if average is not None:
        raise ddl.DDLConfigError("pass op=hvd.Adasum or average (deprecated), not both")
    _adasum.check_size(st.size)
    pre, post = float(prescale), float(postscale)
    fw = _ops_of(ts)
    sent = [compression.compress(t) for t in ts]
    if pre != 1.0:
        sent = [(fw.scaled(s, pre), ctx) for s, ctx in sent]
    flats = [_tensors.flatten(s, name=name or "tensor") for s, _ in sent]
    by_code: dict[int, list[int]] = {}
    for i, f in enumerate(flats):
        _adasum.check_dtype(f.dtype.code)
        by_code.setdefault(f.dtype.code, []).append(i)
    code = _adasum.ADASUM_CODE
    if single:
        s = sent[0][0]
        call = _AdasumCall(ng.ALLREDUCE, code, code_of(s), tuple(s.shape), pre=pre,
                           post=post, name=name)
    else:
        ss = [s for s, _ in sent]
        call = _AdasumCall(ng.GROUPED_ALLREDUCE, code, pre=pre, post=post, name=name,
                           count=len(ss), numel=sum(fw.numel(s) for s in ss),
                           ndim=max((fw.ndim(s) for s in ss), default=0),
                           layout=_members(fw, ss, False))

    def data(r: np.ndarray) -> list[np.ndarray]:
        if r[ng.JOINED] == 1:
            raise ddl.DDLConfigError(
                "hvd.allreduce(op=hvd.Adasum) while a rank has called hvd.join(): joined "
                "ranks do not serve Adasum calls; use op=hvd.Average with join, or give "
                "every rank the same number of batches")
        outs: list[np.ndarray] = [f.array for f in flats]  # empty members stay as they are
        for members in by_code.values():
            numels = [flats[i].array.size for i in members]
            if not sum(numels):
                continue
            row = np.concatenate([flats[i].array for i in members]).reshape(1, -1)
            rows = _api.plan_allgather(row, st.group)()
            dt = flats[members[0]].dtype
            got, coefs = _adasum.tree(rows, numels, dt)
            if st.size > 1:
                # the lowest rank's coefficients for all: a rank whose dot products rounded
                # otherwise (another CPU kind) redoes the exact scaled adds with them
                agreed = coefs.copy()
                _api.plan_broadcast(agreed, 0, inplace=True, group=st.group)()
                if not np.array_equal(agreed, coefs, equal_nan=True):
                    got, _ = _adasum.tree(rows, numels, dt, coefs=agreed)
            off = 0
            for i, n in zip(members, numels):
                outs[i] = got[off:off + n]
                off += n
        return outs

    def finish(outs: list[np.ndarray]) -> Any:
        done = []
        with fw.no_grad():
            for i, (flat, got) in enumerate(zip(flats, outs)):
                out, view = _tensors.empty_like(flat)
                view.array[...] = got
                view.write_back()
                if post != 1.0:
                    fw.scale_(out, post)
                out = compression.decompress(out, sent[i][1])
                if inplace:
                    fw.copy_(ts[i], out)
                    out = ts[i]
                done.append(out)
        return done[0] if single else done

    return Planned(call, data, finish)


# ------------------------------------------------------------------- allgather
def _at_least_1d(fw: Any, t: Any) -> Any:
    return t if fw.ndim(t) else fw.reshape(t, (1,))


def allgather(tensor: Any, *, name: str | None = None, process_set: Any = None,
              async_: bool = False) -> Any:
    """Every rank's ``tensor`` concatenated along dimension 0 (sizes may differ); a 0-d
    tensor counts as one row, as in Horovod."""
    fw = ops_for(tensor)

    st = scope(process_set)

    def plan() -> Planned:
        t = _at_least_1d(fw, tensor)
        data = _api.plan_allgather(t, st.group)
        return Planned(Call(ng.ALLGATHER, code=code_of(t), shape=tuple(t.shape), name=name),
                       _no_r(data))

    return submit(ng.ALLGATHER, name, plan, async_=async_, label=name or "allgather",
                  scope=st)


def grouped_allgather(tensors: Sequence[Any], *, name: str | None = None,
                      process_set: Any = None, async_: bool = False) -> Any:
    st = scope(process_set)

    def plan() -> Planned:
        fw = _ops_of(list(tensors))
        ts = [_at_least_1d(fw, t) for t in tensors]
        steps = [_api.plan_allgather(t, st.group) for t in ts]
        call = Call(ng.GROUPED_ALLGATHER, name=name, count=len(ts),
                    ndim=max((fw.ndim(t) for t in ts), default=0),
                    layout=_members(fw, ts, True))
        return Planned(call, lambda r: [step() for step in steps])

    return submit(ng.GROUPED_ALLGATHER, name, plan, async_=async_,
                  label=name or "grouped_allgather", scope=st)


def row_offsets(dims: Sequence[int], process_set: Any = None) -> list[tuple[int, int]]:
    """Where this rank's rows of each gathered tensor start, and how many there are: one
    allgather of this rank's first dimensions, as Horovod's allgather gradients do."""
    table = allgather(np.asarray([list(dims)], dtype=np.int64), process_set=process_set)
    me = scope(process_set).rank
    before = table[:me].sum(axis=0).tolist() if me else [0] * len(dims)
    return [(int(b), int(d)) for b, d in zip(before, dims)]


# ------------------------------------------------------------------- broadcast
def broadcast(tensor: Any, root_rank: int, *, name: str | None = None, inplace: bool = False,
              process_set: Any = None, async_: bool = False) -> Any:
    st = scope(process_set)

    def plan() -> Planned:
        root, local = check_root(root_rank, st)
        data = _api.plan_broadcast(tensor, local, inplace=inplace, group=st.group)
        call = Call(ng.BROADCAST, code=code_of(tensor), shape=tuple(tensor.shape), arg=root,
                    name=name)
        return Planned(call, _no_r(data))

    return submit(ng.BROADCAST, name, plan, async_=async_,
                  label=name or ("broadcast_" if inplace else "broadcast"), scope=st)


def broadcast_group_(tensors: Callable[[], Sequence[Any]], root_rank: int,
                     name: str | None = None, what: str = "broadcast_parameters",
                     process_set: Any = None) -> None:
    """``broadcast`` in place of every tensor ``tensors()`` gives, as one call. The tensors
    are collected inside the call's plan, so a failure there is agreed too."""
    st = scope(process_set)

    def plan() -> Planned:
        root, local = check_root(root_rank, st)
        ts = list(tensors())
        fw = _ops_of(ts)
        steps = [_api.plan_broadcast(t, local, inplace=True, group=st.group) for t in ts]
        call = Call(ng.GROUPED_BROADCAST, arg=root, name=name, count=len(ts),
                    numel=sum(fw.numel(t) for t in ts),
                    ndim=max((fw.ndim(t) for t in ts), default=0),
                    layout=_members(fw, ts, False))
        return Planned(call, lambda r: [step() for step in steps])

    submit(ng.GROUPED_BROADCAST, name, plan, async_=False, label=name or what, scope=st)


# ------------------------------------------------------------------- alltoall
def alltoall_splits(rows: int, splits: Sequence[int] | None, n: int | None = None
                    ) -> list[int]:
    """How many rows go to each of ``n`` ranks (the job's by default): ``splits``,
    checked, or an even split."""
    n = ddl.size() if n is None else n
    if splits is None:
        if rows % n:
            raise ddl.DDLConfigError(
                f"alltoall: dimension 0 has {rows} rows, not divisible by {n} ranks; pass splits"
            )
        return [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ddl.DDLConfigError(
            f"alltoall: splits {splits} must be {n} non-negative counts summing to {rows}"
        )
    return splits


def alltoall_receive(table: np.ndarray, data: Any, tail: tuple[int, ...],
                     me: int | None = None) -> tuple[Any, Any]:
    """Rank ``me``'s rows (this rank's by default) out of every rank's gathered rows
    (``table[i][j]``: rows rank i sends to rank j, in j order), and how many came from
    each rank."""
    fw = ops_for(data)
    me = ddl.rank() if me is None else me
    pieces, start = [], 0
    for i in range(table.shape[0]):
        off = start + int(table[i, :me].sum())
        pieces.append(data[off:off + int(table[i, me])])
        start += int(table[i].sum())
    # The row count, not -1: a row of no elements ([2, 0]) leaves -1 undetermined
    out = fw.reshape(fw.cat(pieces), (int(table[:, me].sum()),) + tuple(tail))
    return out, fw.counts(table[:, me])


def alltoall(tensor: Any, splits: Any = None, *, name: str | None = None,
             process_set: Any = None, async_: bool = False, with_splits: bool = False) -> Any:
    """Send ``splits[j]`` rows to rank ``j``; the rows received (and, with ``splits`` or
    ``with_splits``, how many came from each rank), as Horovod's alltoall."""
    fw = ops_for(tensor)

    st = scope(process_set)

    def plan() -> Planned:
        s = None if splits is None else fw.rows(splits)
        nd = fw.ndim(tensor)
        rows = tensor.shape[0] if nd else 1
        row = int(np.prod(tuple(tensor.shape[1:]), dtype=np.int64)) if nd else 1
        send = alltoall_splits(rows, s, st.size)
        table = _api.plan_allgather(np.asarray([send], dtype=np.int64), st.group)
        data = _api.plan_allgather(fw.reshape(tensor, (rows, row)), st.group)
        tail = tuple(tensor.shape[1:])

        def finish(got: tuple[np.ndarray, Any]) -> Any:
            out, received = alltoall_receive(got[0], got[1], tail, st.rank)
            return out if splits is None and not with_splits else (out, received)

        call = Call(ng.ALLTOALL, code=code_of(tensor), shape=tuple(tensor.shape), name=name)
        return Planned(call, lambda r: (table(), data()), finish)

    return submit(ng.ALLTOALL, name, plan, async_=async_, label=name or "alltoall",
                  scope=st)


# -------------------------------------------------------------- reducescatter
def reducescatter(tensors: Sequence[Any], *, op: Any = None, name: str | None = None,
                  compression: type[Compressor] = NoneCompressor, process_set: Any = None,
                  prescale: float = 1.0, postscale: float = 1.0, grouped: bool = False,
                  async_: bool = False) -> Any:
    """The one reducescatter: reduce over ranks, then this rank's block of dimension 0
    (``ddl.split_rows``: as even as possible, lower ranks first, as Horovod splits it).
    One tensor is a REDUCE_SCATTER call, a group one GROUPED_REDUCE_SCATTER call."""
    kind = ng.GROUPED_REDUCE_SCATTER if grouped else ng.REDUCE_SCATTER

    st = scope(process_set)

    def plan() -> Planned:
        rop = resolve_op(None, op)
        pre, post = float(prescale), float(postscale)
        fw = _ops_of(list(tensors))
        sent = [compression.compress(t) for t in tensors]
        steps, scales = [], []
        for i, (s, _) in enumerate(sent):
            if pre != 1.0:
                s = fw.scaled(s, pre)
                sent[i] = (s, sent[i][1])
            engine_op, scale = reduction(rop, s, post, st.size)
            steps.append(_api.plan_reduce_scatter(s, engine_op, st.group))
            scales.append(scale)
        if grouped:
            ss = [s for s, _ in sent]
            call = Call(kind, rop, pre=pre, post=post, name=name, count=len(sent),
                        numel=sum(fw.numel(s) for s in ss),
                        ndim=max((fw.ndim(s) for s in ss), default=0),
                        layout=_members(fw, ss, False))
        else:
            s = sent[0][0]
            call = Call(kind, rop, code_of(s), tuple(s.shape), pre=pre, post=post, name=name)

        def finish(outs: list[Any]) -> Any:
            done = []
            for out, scale, (_, ctx) in zip(outs, scales, sent):
                if scale != 1.0:
                    fw.scale_(out, scale)
                done.append(compression.decompress(out, ctx))
            return done if grouped else done[0]

        return Planned(call, lambda r: [step() for step in steps], finish)

    return submit(kind, name, plan, async_=async_, label=name or ng.NAMES[kind],
                  scope=st)


# --------------------------------------------------------------- barrier, objects
def barrier(process_set: Any = None) -> None:
    st = scope(process_set)

    def plan() -> Planned:
        return Planned(Call(ng.BARRIER), lambda r: None)

    submit(ng.BARRIER, None, plan, async_=False, label="barrier", scope=st)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None, *, pickler: Any = NumpyOps) -> Any:
    """``root_rank``'s ``obj`` on every rank (pickled by ``pickler.dumps``/``loads``): one
    call, whose exchange also carries the root's payload length."""

    st = scope(process_set)

    def plan() -> Planned:
        root, local = check_root(root_rank, st)
        payload = pickler.dumps(obj) if ddl.rank() == root else None

        def data(r: np.ndarray) -> np.ndarray:
            buf = (payload if payload is not None
                   else np.empty(int(r[ng.PAYLOAD]), dtype=np.uint8))
            _api.plan_broadcast(buf, local, inplace=True, group=st.group)()
            return buf

        def finish(buf: np.ndarray) -> Any:
            return obj if payload is not None else pickler.loads(buf)

        return Planned(Call(ng.BROADCAST_OBJECT, arg=root, name=name), data, finish,
                       payload=0 if payload is None else payload.size)

    return submit(ng.BROADCAST_OBJECT, name, plan, async_=False,
                  label=name or "broadcast_object", scope=st)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None, *,
                     pickler: Any = NumpyOps) -> list[Any]:
    """Every rank's ``obj``, in rank order."""

    st = scope(process_set)

    def plan() -> Planned:
        payload = pickler.dumps(obj)

        def data(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            sizes = np.asarray([payload.size], dtype=np.int64)
            lengths = _api.plan_allgather(sizes, st.group)()
            return lengths, _api.plan_allgather(payload, st.group)()

        def finish(got: tuple[np.ndarray, np.ndarray]) -> list[Any]:
            out, off = [], 0
            for n in got[0].tolist():
                out.append(pickler.loads(got[1][off:off + n]))
                off += n
            return out

        return Planned(Call(ng.ALLGATHER_OBJECT, name=name), data, finish)

    return submit(ng.ALLGATHER_OBJECT, name, plan, async_=False,
                  label=name or "allgather_object", scope=st)


def shutdown_exchange() -> None:
    """``hvd.shutdown()``'s collective step: every rank has finished the calls before it,
    and a rank still inside another collective hears that this one shuts down."""
    submit(ng.SHUTDOWN, None, lambda: Planned(Call(ng.SHUTDOWN), lambda r: None),
           async_=False, label="shutdown")


__all__ = [
    "ProcessSet", "scope", "allgather", "allgather_object", "allreduce", "alltoall",
    "alltoall_receive", "alltoall_splits", "barrier", "broadcast", "broadcast_group_",
    "broadcast_object", "check_process_set", "check_root", "global_process_set",
    "grouped_allgather", "grouped_allreduce", "reducescatter", "reduction", "resolve_op",
    "row_offsets", "shutdown_exchange", "submit_allreduce",
]
