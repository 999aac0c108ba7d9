"""Horovod's collectives, once, for every framework adapter.

Each collective has one implementation: a *plan* (check the arguments, compress, build the
core's data step and the call's identity) handed to :func:`ddl.hvd.negotiate.submit`, which
queues the data behind the call's identity exchange. Whatever a plan raises still takes
part in that exchange, so an error on one rank is an error on every rank, and two different
calls never pair. The arrays may be numpy arrays or torch tensors (:mod:`ddl.hvd.arrays`);
``ddl.torch`` adds autograd and Horovod's signatures on top, ``ddl.tensorflow`` the
conversion from TensorFlow tensors and the gradients.

This module holds the reductions (allreduce, grouped, the DistributedOptimizer's bucket
allreduce, reducescatter) and is where the adapters find every collective: the others live
in :mod:`.movement` (allgather, broadcast, alltoall) and :mod:`.objects` (objects, barrier,
the shutdown step), Adasum's call in :mod:`.adasum_plan`, the argument checks every plan
shares in :mod:`.arguments`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import ddl
from ddl import api as _api

from . import adasum as _adasum
from . import negotiate as ng
from .adasum_plan import adasum_plan
from .arguments import (
    check_process_set,
    check_root,
    members_layout,
    ops_of,
    reduction,
    resolve_op,
    without_row,
)
from .arrays import ops_for
from .compression import Compressor, NoneCompressor, passthrough
from .movement import (
    allgather,
    alltoall,
    alltoall_receive,
    alltoall_splits,
    broadcast,
    broadcast_group_,
    grouped_allgather,
    row_offsets,
)
from .named import submit
from .negotiate import Call, Planned, code_of
from .objects import allgather_object, barrier, broadcast_object, shutdown_exchange
from .process_sets import ProcessSet, global_process_set, scope


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
                      lambda: adasum_plan([tensor], True, average, name, prescale, postscale,
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
        return Planned(sig.call, without_row(data))  # the engine's result is the answer

    def finish(out: Any) -> Any:
        if scale != 1.0:
            fw.scale_(out, scale)
        if inplace:
            if out is not tensor:
                fw.copy_(tensor, out)
            return tensor
        return out

    return Planned(sig.call, without_row(data), finish)


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

    return Planned(call, without_row(data), finish)


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
            return Planned(call, without_row(data), before=before)
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

        return Planned(call, without_row(data), finish, before=before)

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
                      lambda: adasum_plan(list(tensors), False, average, name, prescale,
                                          postscale, compression, inplace, st),
                      async_=async_, label=name or "grouped_allreduce", scope=st)

    def plan() -> Planned:
        rop = resolve_op(average, op)
        pre, post = float(prescale), float(postscale)
        ts = list(tensors)
        fw = ops_of(ts)
        sent = [compression.compress(t) for t in ts]
        call = Call(ng.GROUPED_ALLREDUCE, rop, pre=pre, post=post, name=name, count=len(ts),
                    numel=sum(fw.numel(s) for s, _ in sent),
                    ndim=max((fw.ndim(s) for s, _ in sent), default=0),
                    layout=members_layout(fw, [s for s, _ in sent], False))
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
        fw = ops_of(list(tensors))
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
                        layout=members_layout(fw, ss, False))
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


__all__ = [
    "ProcessSet", "scope", "allgather", "allgather_object", "allreduce", "alltoall",
    "alltoall_receive", "alltoall_splits", "barrier", "broadcast", "broadcast_group_",
    "broadcast_object", "check_process_set", "check_root", "global_process_set",
    "grouped_allgather", "grouped_allreduce", "reducescatter", "reduction", "resolve_op",
    "row_offsets", "shutdown_exchange", "submit_allreduce",
]
