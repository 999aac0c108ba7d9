"""Horovod's ``horovod.torch`` collectives, with Horovod's arguments, over the ddl core.

Each collective has one implementation: a *plan* (check the arguments, compress, build the
core's data step and the call's identity) handed to :func:`ddl.torch.negotiate.submit`,
which queues the data behind the call's identity exchange; the blocking, in-place and
``_async`` spellings are thin wrappers. Whatever a plan raises still takes part in that
exchange, so an error on one rank is an error on every rank, and two different calls never
pair. Handles have ``wait()``/``poll()``, so ``hvd.synchronize`` and ``ddl.synchronize``
both take them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import ddl
from ddl import api as _api
from ddl.ops import parse_op

from . import collectives
from . import negotiate as ng
from .compression import Compression, Compressor
from .join import join as _join
from .negotiate import Call, Handle, Planned, code_of, device_of, submit


class ProcessSet:
    """Horovod's process sets. Only the global one (every rank) exists in ddl today."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks = list(ranks) if ranks is not None else None

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def _check_process_set(process_set: Any) -> None:
    if process_set is None or process_set is global_process_set:
        return
    if isinstance(process_set, ProcessSet) and (
        process_set.ranks is None or sorted(process_set.ranks) == list(range(ddl.size()))
    ):
        return
    raise NotImplementedError(
        "ddl.torch: process sets other than the global one are not supported; use "
        "torch.distributed.new_group on the 'ddl' backend for sub-groups"
    )


def add_process_set(process_set: Any) -> ProcessSet:
    raise NotImplementedError("ddl.torch: add_process_set is not supported (global set only)")


def synchronize(handle: Any) -> Any:
    """Wait for an ``*_async`` call and return its output."""
    return handle.wait()


def poll(handle: Any) -> bool:
    """True when the ``*_async`` call has finished."""
    return handle.poll()


def _op(average: bool | None, op: Any) -> ddl.ReduceOp:
    if average is not None:
        if op is not None:
            raise ddl.DDLConfigError("pass op or average (deprecated), not both")
        return ddl.Average if average else ddl.Sum
    if op is None:
        return ddl.Average
    if isinstance(op, str) and op.lower() == "adasum":
        raise NotImplementedError("ddl.torch: Adasum is not implemented; use op=hvd.Average")
    return parse_op(op)


def _root(root_rank: Any) -> int:
    root = operator.index(root_rank)
    if not 0 <= root < ddl.size():
        raise ddl.DDLConfigError(f"root_rank {root} is outside 0..{ddl.size() - 1}")
    return root


def _no_r(step: Callable[[], Any]) -> Callable[[np.ndarray], Any]:
    return lambda r: step()


def _needs_grad(tensors: Any) -> bool:
    if not torch.is_grad_enabled():
        return False
    try:
        return any(getattr(t, "requires_grad", False) for t in tensors)
    except TypeError:
        return False  # not a sequence: the plan raises, on every rank


# ------------------------------------------------------------------- scaling
def _integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``factor * t`` as Horovod's ScaleBuffer computes it: an integer tensor is multiplied
    in float64 and cast back to its dtype (truncated toward zero), never promoted."""
    if _integer(t):
        return (t.to(torch.float64) * factor).to(t.dtype)
    return t * factor


def _scale_(t: torch.Tensor, factor: float) -> None:
    """:func:`_scaled`, in place."""
    with torch.no_grad():
        if _integer(t):
            t.copy_(t.to(torch.float64).mul_(factor))
        else:
            t.mul_(factor)


def _reduction(rop: ddl.ReduceOp, t: torch.Tensor, post: float) -> tuple[ddl.ReduceOp, float]:
    """The op the engine runs and the postscale applied after it. Horovod averages by
    summing and multiplying by ``postscale / size`` (in float64): for an integer tensor that
    is exactly what happens here, so the result truncates toward zero as in Horovod."""
    engine_op = ng.engine_op(rop, code_of(t))
    if engine_op is not rop:
        return engine_op, post / ddl.size()
    return rop, post


# ------------------------------------------------------------------- allreduce
def _allreduce(tensor: torch.Tensor, average: bool | None, name: str | None, op: Any,
               prescale_factor: float, postscale_factor: float,
               compression: type[Compressor], inplace: bool, process_set: Any,
               async_: bool) -> Any:
    """The one allreduce. Blocking calls (``async_=False``) run on the caller's thread when
    nothing is queued, like the core's: no hand-off to the worker thread."""

    def plan() -> Planned:
        _check_process_set(process_set)
        rop = _op(average, op)
        pre, post = float(prescale_factor), float(postscale_factor)
        sent, ctx = compression.compress(tensor)
        if pre != 1.0:
            sent = _scaled(sent, pre)
        engine_op, scale = _reduction(rop, sent, post)
        # In place whenever the tensor sent is ours to overwrite: the caller's own for the
        # in-place spellings, or a temporary made by compression or prescaling. Out of place
        # would allocate a fresh result (page faults on every call for large tensors).
        data = _api._plan_allreduce(sent, engine_op, None, inplace or sent is not tensor)
        call = Call(ng.ALLREDUCE, rop, code_of(sent), tuple(sent.shape), pre=pre, post=post,
                    name=name)

        def finish(out: torch.Tensor) -> torch.Tensor:
            if scale != 1.0:
                _scale_(out, scale)
            out = compression.decompress(out, ctx)
            if inplace:
                if out is not tensor:
                    with torch.no_grad():
                        tensor.copy_(out)
                return tensor
            return out

        return Planned(call, _no_r(data), finish)

    return submit(ng.ALLREDUCE, name, plan, async_=async_, label=name or "allreduce")


class _AllreduceFn(torch.autograd.Function):
    """Horovod's allreduce is differentiable: the gradient is the allreduce of the gradient."""

    @staticmethod
    def forward(ctx, tensor, average, op, prescale, postscale, compression, name, process_set):
        ctx.args = (average, op, prescale, postscale, compression, process_set)
        return _allreduce(tensor, average, name, op, prescale, postscale, compression, False,
                          process_set, False)

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale, compression, process_set = ctx.args
        out = _allreduce(grad.contiguous(), average, None, op, prescale, postscale,
                         compression, False, process_set, False)
        return out, None, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """Average (or ``op``) of ``tensor`` over all ranks, as a new tensor."""
    if getattr(tensor, "requires_grad", False) and torch.is_grad_enabled():
        return _AllreduceFn.apply(tensor, average, op, prescale_factor, postscale_factor,
                                  compression, name, process_set)
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                      compression, False, process_set, False)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                      Compression.none, False, process_set, True)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> torch.Tensor:
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                      Compression.none, True, process_set, False)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                      Compression.none, True, process_set, True)


def submit_allreduce(tensor: Any, op: ddl.ReduceOp, *, name: str, inplace: bool = False,
                     async_: bool = True, prescale: float = 1.0, postscale: float = 1.0,
                     before: Callable[[], None] | None = None,
                     sources: list | None = None) -> Any:
    """The DistributedOptimizer's bucket allreduce (already packed, scaled by the caller).
    With ``sources``, ``tensor`` is the fusion buffer they would be packed into, never
    packed: their sum goes into it, or back into the sources when ``inplace`` (ranks that
    joined see an allreduce of ``tensor`` either way). ``name`` labels the handle only."""

    def plan() -> Planned:
        if sources is None:
            data = _api._plan_allreduce(tensor, op, None, inplace)
        else:
            data = _api._plan_allreduce_into(sources, None if inplace else tensor, op)
        call = Call(ng.ALLREDUCE, op, code_of(tensor), tuple(tensor.shape), pre=prescale,
                    post=postscale)
        return Planned(call, _no_r(data), before=before)

    return submit(ng.ALLREDUCE, None, plan, async_=async_, label=name)


# ------------------------------------------------------------ grouped allreduce
def _grouped(tensors: Sequence[torch.Tensor], average: bool | None, name: str | None, op: Any,
             prescale_factor: float, postscale_factor: float, compression: type[Compressor],
             inplace: bool, process_set: Any, async_: bool) -> Any:
    """One call, whose descriptor covers every member: one fused allreduce per (dtype,
    device), all in the same queued work (Horovod's grouped_allreduce fuses too)."""

    def plan() -> Planned:
        _check_process_set(process_set)
        rop = _op(average, op)
        pre, post = float(prescale_factor), float(postscale_factor)
        ts = list(tensors)
        sent = [compression.compress(t) for t in ts]
        members = ng.layout([(code_of(s), device_of(s), tuple(s.shape)) for s, _ in sent],
                            gathering=False)
        call = Call(ng.GROUPED_ALLREDUCE, rop, pre=pre, post=post, name=name, count=len(ts),
                    numel=sum(s.numel() for s, _ in sent),
                    ndim=max((s.dim() for s, _ in sent), default=0), layout=members)
        rows = call.members()
        direct = inplace and compression is Compression.none and pre == 1.0
        parts: list[tuple[list[int], torch.Tensor | None, Callable[[], Any], float]] = []
        with torch.no_grad():
            for idx in ng.buckets(rows):
                engine_op, scale = _reduction(rop, sent[idx[0]][0], post)
                if direct and rows[idx[0], 1] == 0:
                    # CPU tensors reduced where they live, as one fused collective: nothing
                    # is packed
                    group = [ts[i] for i in idx]
                    parts.append((idx, None, _api._plan_allreduce_into(group, None, engine_op),
                                  scale))
                    continue
                flat = torch.cat([sent[i][0].reshape(-1) for i in idx])
                if pre != 1.0:
                    _scale_(flat, pre)
                parts.append((idx, flat, _api._plan_allreduce(flat, engine_op, None, True),
                              scale))

        def finish(_: Any) -> list[torch.Tensor]:
            out: list[Any] = [None] * len(ts)
            with torch.no_grad():
                for idx, flat, _step, scale in parts:
                    if flat is None:  # reduced in place, where the tensors live
                        for i in idx:
                            if scale != 1.0:
                                _scale_(ts[i], scale)
                            out[i] = ts[i]
                        continue
                    if scale != 1.0:
                        _scale_(flat, scale)
                    off = 0
                    for i in idx:
                        s, ctx = sent[i]
                        n = s.numel()
                        r = compression.decompress(flat[off:off + n].view(s.shape), ctx)
                        off += n
                        if inplace:
                            ts[i].copy_(r)
                            r = ts[i]
                        out[i] = r
            return out

        return Planned(call, lambda r: [step() for _, _, step, _ in parts], finish)

    return submit(ng.GROUPED_ALLREDUCE, name, plan, async_=async_,
                  label=name or "grouped_allreduce")


class _GroupedAllreduceFn(torch.autograd.Function):
    """Horovod's grouped_allreduce is differentiable: the gradients are the grouped
    allreduce of the gradients."""

    @staticmethod
    def forward(ctx, average, op, prescale, postscale, compression, name, process_set,
                *tensors):
        ctx.args = (average, op, prescale, postscale, compression, process_set)
        return tuple(_grouped(tensors, average, name, op, prescale, postscale, compression,
                              False, process_set, False))

    @staticmethod
    def backward(ctx, *grads):
        average, op, prescale, postscale, compression, process_set = ctx.args
        out = _grouped([g.contiguous() for g in grads], average, None, op, prescale,
                       postscale, compression, False, process_set, False)
        return (None,) * 7 + tuple(out)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None
                      ) -> list[torch.Tensor]:
    if _needs_grad(tensors):
        return list(_GroupedAllreduceFn.apply(average, op, prescale_factor, postscale_factor,
                                              compression, name, process_set, *tensors))
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor,
                    compression, False, process_set, False)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> Handle:
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor,
                    Compression.none, False, process_set, True)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None
                       ) -> list[torch.Tensor]:
    """In place, as in Horovod outside autograd: tensors that require grad are updated
    without recording a graph."""
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor,
                    Compression.none, True, process_set, False)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> Handle:
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor,
                    Compression.none, True, process_set, True)


# ------------------------------------------------------------------- allgather
def _allgather(tensor: torch.Tensor, name: str | None, process_set: Any, async_: bool) -> Any:
    def plan() -> Planned:
        _check_process_set(process_set)
        t = tensor if tensor.dim() else tensor.reshape(1)
        data = _api._plan_allgather(t)
        return Planned(Call(ng.ALLGATHER, code=code_of(t), shape=tuple(t.shape), name=name),
                       _no_r(data))

    return submit(ng.ALLGATHER, name, plan, async_=async_, label=name or "allgather")


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = None) -> Handle:
    return _allgather(tensor, name, process_set, True)


def _offsets(dims: Sequence[int], process_set: Any) -> list[tuple[int, int]]:
    """Where this rank's rows of each gathered tensor start, and how many there are: one
    allgather of this rank's first dimensions, as Horovod's gradients do."""
    table = _allgather(torch.tensor([list(dims)], dtype=torch.int64), None, process_set,
                       False)
    before = table[:ddl.rank()].sum(dim=0).tolist() if ddl.rank() else [0] * len(dims)
    return [(int(b), int(d)) for b, d in zip(before, dims)]


class _AllgatherFn(torch.autograd.Function):
    """Horovod's allgather gradient: the Average allreduce of the gradient, of which this
    rank takes its own rows (``HorovodAllgather.backward``)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        ctx.scalar = tensor.dim() == 0
        return _allgather(tensor, name, process_set, False)

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce(grad.contiguous(), None, None, ddl.Average, 1.0, 1.0,
                             Compression.none, False, ctx.process_set, False)
        (start, n), = _offsets([ctx.dim], ctx.process_set)
        out = reduced.narrow(0, start, n)
        return (out.reshape(()) if ctx.scalar else out), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """Concatenation of every rank's ``tensor`` along dimension 0 (sizes may differ).
    Differentiable, as in Horovod."""
    if _needs_grad([tensor]):
        return _AllgatherFn.apply(tensor, name, process_set)
    return _allgather(tensor, name, process_set, False)


def _grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None, process_set: Any,
                       async_: bool) -> Any:
    def plan() -> Planned:
        _check_process_set(process_set)
        ts = [t if t.dim() else t.reshape(1) for t in tensors]
        steps = [_api._plan_allgather(t) for t in ts]
        members = ng.layout([(code_of(t), device_of(t), tuple(t.shape)) for t in ts],
                            gathering=True)
        call = Call(ng.GROUPED_ALLGATHER, name=name, count=len(ts),
                    ndim=max((t.dim() for t in ts), default=0), layout=members)
        return Planned(call, lambda r: [step() for step in steps])

    return submit(ng.GROUPED_ALLGATHER, name, plan, async_=async_,
                  label=name or "grouped_allgather")


class _GroupedAllgatherFn(torch.autograd.Function):
    """``_AllgatherFn`` for a group: one grouped Average allreduce of the gradients, one
    allgather of the first dimensions."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.scalars = [t.dim() == 0 for t in tensors]
        ctx.process_set = process_set
        return tuple(_grouped_allgather(tensors, name, process_set, False))

    @staticmethod
    def backward(ctx, *grads):
        reduced = _grouped([g.contiguous() for g in grads], None, None, ddl.Average, 1.0,
                           1.0, Compression.none, False, ctx.process_set, False)
        out = []
        for r, (start, n), scalar in zip(reduced, _offsets(ctx.dims, ctx.process_set),
                                         ctx.scalars):
            piece = r.narrow(0, start, n)
            out.append(piece.reshape(()) if scalar else piece)
        return (None, None) + tuple(out)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[torch.Tensor]:
    """``allgather`` of each tensor, as one call. Differentiable."""
    if _needs_grad(tensors):
        return list(_GroupedAllgatherFn.apply(name, process_set, *tensors))
    return _grouped_allgather(tensors, name, process_set, False)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = None) -> Handle:
    return _grouped_allgather(tensors, name, process_set, True)


# ------------------------------------------------------------------- broadcast
def _broadcast(tensor: torch.Tensor, root_rank: int, name: str | None, inplace: bool,
               process_set: Any, async_: bool) -> Any:
    def plan() -> Planned:
        _check_process_set(process_set)
        root = _root(root_rank)
        data = _api._plan_broadcast(tensor, root, inplace)
        call = Call(ng.BROADCAST, code=code_of(tensor), shape=tuple(tensor.shape), arg=root,
                    name=name)
        return Planned(call, _no_r(data))

    return submit(ng.BROADCAST, name, plan, async_=async_,
                  label=name or ("broadcast_" if inplace else "broadcast"))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = None) -> Handle:
    return _broadcast(tensor, root_rank, name, False, process_set, True)


class _BroadcastFn(torch.autograd.Function):
    """Horovod's broadcast gradient (``HorovodBroadcast.backward``): the Average allreduce
    of the gradient on the root, zeros elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return _broadcast(tensor, root_rank, name, False, process_set, False)

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce(grad.contiguous(), None, None, ddl.Average, 1.0, 1.0,
                             Compression.none, False, ctx.process_set, False)
        if ddl.rank() != ctx.root:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor. Differentiable."""
    if _needs_grad([tensor]):
        return _BroadcastFn.apply(tensor, root_rank, name, process_set)
    return _broadcast(tensor, root_rank, name, False, process_set, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = None) -> Handle:
    return _broadcast(tensor, root_rank, name, True, process_set, True)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = None) -> torch.Tensor:
    return _broadcast(tensor, root_rank, name, True, process_set, False)


def broadcast_group_(tensors: Callable[[], Sequence[torch.Tensor]], root_rank: int,
                     name: str | None = None, what: str = "broadcast_parameters") -> None:
    """``broadcast_`` of every tensor ``tensors()`` gives, as one call. The tensors are
    collected inside the call's plan, so a failure there is agreed too."""

    def plan() -> Planned:
        root = _root(root_rank)
        ts = list(tensors())
        steps = [_api._plan_broadcast(t, root, True) for t in ts]
        members = ng.layout([(code_of(t), device_of(t), tuple(t.shape)) for t in ts],
                            gathering=False)
        call = Call(ng.GROUPED_BROADCAST, arg=root, name=name, count=len(ts),
                    numel=sum(t.numel() for t in ts),
                    ndim=max((t.dim() for t in ts), default=0), layout=members)
        return Planned(call, lambda r: [step() for step in steps])

    submit(ng.GROUPED_BROADCAST, name, plan, async_=False, label=name or what)


# ------------------------------------------------- alltoall, reduce_scatter
def _alltoall(tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any,
              async_: bool, with_splits: bool = False) -> Any:
    def plan() -> Planned:
        _check_process_set(process_set)
        s = None if splits is None else [int(x) for x in (
            splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        rows = tensor.shape[0] if tensor.dim() else 1
        row = int(np.prod(tuple(tensor.shape[1:]), dtype=np.int64)) if tensor.dim() else 1
        send = collectives.alltoall_splits(rows, s)
        table = _api._plan_allgather(np.asarray([send], dtype=np.int64))
        data = _api._plan_allgather(tensor.reshape(rows, row))
        tail = tuple(tensor.shape[1:])

        def finish(got: tuple[np.ndarray, Any]) -> Any:
            out, received = collectives.alltoall_receive(got[0], got[1], tail)
            return out if splits is None and not with_splits else (out, received)

        call = Call(ng.ALLTOALL, code=code_of(tensor), shape=tuple(tensor.shape), name=name)
        return Planned(call, lambda r: (table(), data()), finish)

    return submit(ng.ALLTOALL, name, plan, async_=async_, label=name or "alltoall")


class _AlltoallFn(torch.autograd.Function):
    """Horovod's alltoall gradient (``HorovodAlltoall.backward``): the alltoall of the
    gradient back, with the splits this rank received."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _alltoall(tensor, splits, name, process_set, False, True)
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *unused):
        back, _ = _alltoall(grad.contiguous(), ctx.received, None, ctx.process_set, False,
                            True)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
             name: str | None = None, process_set: Any = None) -> Any:
    """Send ``splits[j]`` rows to rank ``j``; returns the rows received (and, when
    ``splits`` is given, how many came from each rank), like Horovod. Differentiable."""
    if _needs_grad([tensor]):
        return _AlltoallFn.apply(tensor, splits, name, process_set)
    return _alltoall(tensor, splits, name, process_set, False)


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | None = None,
                   name: str | None = None, process_set: Any = None) -> Handle:
    return _alltoall(tensor, splits, name, process_set, True)


def _reducescatter(tensors: Sequence[torch.Tensor], op: Any, name: str | None,
                   compression: type[Compressor], process_set: Any, prescale_factor: float,
                   postscale_factor: float, grouped: bool, async_: bool) -> Any:
    """The one reducescatter: reduce over ranks, then this rank's block of dimension 0
    (``ddl.split_rows``: as even as possible, lower ranks first, as Horovod splits it).
    One tensor is a REDUCE_SCATTER call, a group one GROUPED_REDUCE_SCATTER call."""
    kind = ng.GROUPED_REDUCE_SCATTER if grouped else ng.REDUCE_SCATTER

    def plan() -> Planned:
        _check_process_set(process_set)
        rop = _op(None, op)
        pre, post = float(prescale_factor), float(postscale_factor)
        sent = [compression.compress(t) for t in tensors]
        steps, scales = [], []
        for i, (s, _) in enumerate(sent):
            if pre != 1.0:
                s = _scaled(s, pre)
                sent[i] = (s, sent[i][1])
            engine_op, scale = _reduction(rop, s, post)
            steps.append(_api._plan_reduce_scatter(s, engine_op))
            scales.append(scale)
        if grouped:
            members = ng.layout([(code_of(s), device_of(s), tuple(s.shape)) for s, _ in sent],
                                gathering=False)
            call = Call(kind, rop, pre=pre, post=post, name=name, count=len(sent),
                        numel=sum(s.numel() for s, _ in sent),
                        ndim=max((s.dim() for s, _ in sent), default=0), layout=members)
        else:
            s = sent[0][0]
            call = Call(kind, rop, code_of(s), tuple(s.shape), pre=pre, post=post, name=name)

        def finish(outs: list[torch.Tensor]) -> Any:
            done = []
            for out, scale, (_, ctx) in zip(outs, scales, sent):
                if scale != 1.0:
                    _scale_(out, scale)
                done.append(compression.decompress(out, ctx))
            return done if grouped else done[0]

        return Planned(call, lambda r: [step() for step in steps], finish)

    return submit(kind, name, plan, async_=async_, label=name or ng.NAMES[kind])


def _one(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor] if isinstance(tensor, torch.Tensor) else tensor  # the plan rejects others


class _ReducescatterFn(torch.autograd.Function):
    """Horovod's reducescatter gradient: the allgather of the gradient, times ``size()``
    for Sum (Horovod's ``test_horovod_reducescatter_grad`` expects ``size`` for a gradient
    of ones, 1 for Average), times the scale factors."""

    @staticmethod
    def forward(ctx, op, name, compression, process_set, prescale, postscale, grouped,
                *tensors):
        ctx.args = (op, process_set, float(prescale) * float(postscale), grouped)
        out = _reducescatter(tensors, op, name, compression, process_set, prescale,
                             postscale, grouped, False)
        return tuple(out) if grouped else out

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, scale, grouped = ctx.args
        factor = scale * (ddl.size() if _op(None, op) is ddl.Sum else 1)
        gathered = _grouped_allgather([g.contiguous() for g in grads], None, process_set,
                                      False)
        if factor != 1.0:
            gathered = [g * factor for g in gathered]
        return (None,) * 7 + tuple(gathered)


def _reducescatter_entry(tensors: Sequence[torch.Tensor], op: Any, name: str | None,
                         compression: type[Compressor], process_set: Any, prescale: float,
                         postscale: float, grouped: bool) -> Any:
    if _needs_grad(tensors):
        out = _ReducescatterFn.apply(op, name, compression, process_set, prescale, postscale,
                                     grouped, *tensors)
        return list(out) if grouped else out
    return _reducescatter(tensors, op, name, compression, process_set, prescale, postscale,
                          grouped, False)


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: Any = None,
                  process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Horovod's ``reducescatter``: the Average (or ``op``) over ranks of ``tensor``, of
    which this rank gets its block of dimension 0. Differentiable."""
    return _reducescatter_entry(_one(tensor), op, name, compression, process_set,
                                prescale_factor, postscale_factor, False)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = None,
                        process_set: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    return _reducescatter(_one(tensor), op, name, Compression.none, process_set,
                          prescale_factor, postscale_factor, False, True)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: Any = None,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """``reducescatter`` of each tensor, as one call. Differentiable."""
    return _reducescatter_entry(list(tensors), op, name, compression, process_set,
                                prescale_factor, postscale_factor, True)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = None, process_set: Any = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0
                                ) -> Handle:
    return _reducescatter(list(tensors), op, name, Compression.none, process_set,
                          prescale_factor, postscale_factor, True, True)


def reduce_scatter(tensor: torch.Tensor, op: Any = None, name: str | None = None,
                   process_set: Any = None) -> torch.Tensor:
    """ddl's earlier spelling of :func:`reducescatter` (``op`` first), kept as an alias."""
    return reducescatter(tensor, name=name, op=op, process_set=process_set)


def reduce_scatter_async(tensor: torch.Tensor, op: Any = None, name: str | None = None,
                         process_set: Any = None) -> Handle:
    return reducescatter_async(tensor, name=name, op=op, process_set=process_set)


# --------------------------------------------------------------- join, barrier
def barrier(process_set: Any = None) -> None:
    def plan() -> Planned:
        _check_process_set(process_set)
        return Planned(Call(ng.BARRIER), lambda r: None)

    submit(ng.BARRIER, None, plan, async_=False, label="barrier")


def join(device: int = -1) -> int:
    """Horovod's ``join``: this rank has no more data. Until every rank has called it, this
    rank keeps taking part in the collectives the others issue (allreduce with zeros, so
    Average still divides by ``size()``; allgather with no rows), which is what lets ranks
    with fewer batches stop early under a DistributedOptimizer. Returns, on every rank, the
    rank that joined last. A broadcast from a joined root raises on the running ranks.
    ``device`` is accepted for compatibility (the zeros live in host memory).
    """
    return _join(device)


# ------------------------------------------------------------------- objects
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (pickled; tensors included): one call, whose
    exchange also carries the root's payload length."""

    def plan() -> Planned:
        _check_process_set(process_set)
        root = _root(root_rank)
        payload = collectives.dumps(obj) if ddl.rank() == root else None

        def data(r: np.ndarray) -> np.ndarray:
            buf = (payload if payload is not None
                   else np.empty(int(r[ng.PAYLOAD]), dtype=np.uint8))
            _api._plan_broadcast(buf, root, True)()
            return buf

        def finish(buf: np.ndarray) -> Any:
            return obj if payload is not None else collectives.loads(buf)

        return Planned(Call(ng.BROADCAST_OBJECT, arg=root, name=name), data, finish,
                       payload=0 if payload is None else payload.size)

    return submit(ng.BROADCAST_OBJECT, name, plan, async_=False,
                  label=name or "broadcast_object")


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order."""

    def plan() -> Planned:
        _check_process_set(process_set)
        payload = collectives.dumps(obj)

        def data(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            lengths = _api._plan_allgather(np.asarray([payload.size], dtype=np.int64))()
            return lengths, _api._plan_allgather(payload)()

        def finish(got: tuple[np.ndarray, np.ndarray]) -> list[Any]:
            out, off = [], 0
            for n in got[0].tolist():
                out.append(collectives.loads(got[1][off:off + n]))
                off += n
            return out

        return Planned(Call(ng.ALLGATHER_OBJECT, name=name), data, finish)

    return submit(ng.ALLGATHER_OBJECT, name, plan, async_=False,
                  label=name or "allgather_object")


# ------------------------------------------------------------------ lifecycle
def shutdown_exchange() -> None:
    """``hvd.shutdown()``'s collective step: every rank has finished the calls before it,
    and a rank still inside another collective hears that this one shuts down."""
    submit(ng.SHUTDOWN, None, lambda: Planned(Call(ng.SHUTDOWN), lambda r: None),
           async_=False, label="shutdown")
