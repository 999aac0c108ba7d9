"""Horovod's ``horovod.torch`` collectives: Horovod's signatures and autograd over the
framework-free implementations in :mod:`ddl.hvd.collectives` (one plan per collective,
each handed to the identity exchange of :mod:`ddl.hvd.negotiate`, so an error on one rank
is an error on every rank and two different calls never pair). The blocking, in-place and
``_async`` spellings are thin wrappers. Handles have ``wait()``/``poll()``, so
``hvd.synchronize`` and ``ddl.synchronize`` both take them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import ddl
from ddl.hvd import basics as _basics  # noqa: F401 - horovod's mpi_ops._basics
from ddl.hvd import collectives as C
from ddl.hvd.arrays import TorchOps
from ddl.hvd.collectives import submit_allreduce  # noqa: F401 - horovod.torch.mpi_ops name
from ddl.hvd.compression import Compression, Compressor
from ddl.hvd.join import join as _join
from ddl.hvd.negotiate import Handle
from ddl.hvd.process_sets import (  # noqa: F401 - horovod.torch.mpi_ops has these names
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
    scope,
)


def synchronize(handle: Any) -> Any:
    """Wait for an ``*_async`` call and return its output (a Horovod-style callable
    handle, as ``sparse_allreduce_async`` returns, is called)."""
    if callable(handle) and not hasattr(handle, "wait"):
        return handle()
    return handle.wait()


def poll(handle: Any) -> bool:
    """True when the ``*_async`` call has finished."""
    return handle.poll()


def _needs_grad(tensors: Any) -> bool:
    if not torch.is_grad_enabled():
        return False
    try:
        return any(getattr(t, "requires_grad", False) for t in tensors)
    except TypeError:
        return False  # not a sequence: the plan raises, on every rank


# ------------------------------------------------------------------- allreduce
def _allreduce(tensor: torch.Tensor, average: bool | None, name: str | None, op: Any,
               prescale_factor: float, postscale_factor: float,
               compression: type[Compressor], process_set: Any, *, inplace: bool = False,
               async_: bool = False) -> Any:
    return C.allreduce(tensor, average=average, name=name, op=op, prescale=prescale_factor,
                       postscale=postscale_factor, compression=compression, inplace=inplace,
                       process_set=process_set, async_=async_)


class _AllreduceFn(torch.autograd.Function):
    """Horovod's allreduce is differentiable: the gradient is the allreduce of the gradient."""

    @staticmethod
    def forward(ctx, tensor, average, op, prescale, postscale, compression, name, process_set):
        ctx.args = (average, op, prescale, postscale, compression, process_set)
        return _allreduce(tensor, average, name, op, prescale, postscale, compression,
                          process_set)

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale, compression, process_set = ctx.args
        out = _allreduce(grad.contiguous(), average, None, op, prescale, postscale,
                         compression, process_set)
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
                      compression, process_set)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                      Compression.none, process_set, async_=True)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> torch.Tensor:
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                      Compression.none, process_set, inplace=True)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                      Compression.none, process_set, inplace=True, async_=True)


# ------------------------------------------------------------ grouped allreduce
def _grouped(tensors: Sequence[torch.Tensor], average: bool | None, name: str | None, op: Any,
             prescale_factor: float, postscale_factor: float, compression: type[Compressor],
             process_set: Any, *, inplace: bool = False, async_: bool = False) -> Any:
    return C.grouped_allreduce(tensors, average=average, name=name, op=op,
                               prescale=prescale_factor, postscale=postscale_factor,
                               compression=compression, inplace=inplace,
                               process_set=process_set, async_=async_)


class _GroupedAllreduceFn(torch.autograd.Function):
    """Horovod's grouped_allreduce is differentiable: the gradients are the grouped
    allreduce of the gradients."""

    @staticmethod
    def forward(ctx, average, op, prescale, postscale, compression, name, process_set,
                *tensors):
        ctx.args = (average, op, prescale, postscale, compression, process_set)
        return tuple(_grouped(tensors, average, name, op, prescale, postscale, compression,
                              process_set))

    @staticmethod
    def backward(ctx, *grads):
        average, op, prescale, postscale, compression, process_set = ctx.args
        out = _grouped([g.contiguous() for g in grads], average, None, op, prescale,
                       postscale, compression, process_set)
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
                    compression, process_set)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> Handle:
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor,
                    Compression.none, process_set, async_=True)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None
                       ) -> list[torch.Tensor]:
    """In place, as in Horovod outside autograd: tensors that require grad are updated
    without recording a graph."""
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor,
                    Compression.none, process_set, inplace=True)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> Handle:
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor,
                    Compression.none, process_set, inplace=True, async_=True)


# ------------------------------------------------------------ sparse allreduce
class _SparseHandle(ddl.Handle):
    """``sparse_allreduce_async``'s handle (a ``ddl.Handle``): ``wait()``, ``poll()``, or
    call it (Horovod returns a function that ``synchronize`` calls)."""

    __slots__ = ("_inner", "_like", "_n")

    def __init__(self, inner: Handle, like: torch.Tensor, average_over: int) -> None:
        super().__init__(inner.name)
        self._inner, self._like, self._n = inner, like, average_over

    def poll(self) -> bool:
        return self._inner.poll()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        indices, values = self._inner.wait(timeout)
        if self._n:
            values = values / self._n
        t = self._like
        return torch.sparse_coo_tensor(indices.t(), values, t.size()).coalesce()

    __call__ = wait


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = None,
                           process_set: Any = global_process_set) -> _SparseHandle:
    """Horovod's: a sparse COO tensor reduced over ranks as the allgather of its indices
    and values (one grouped call), summed (``op=Sum``) or averaged (the default) when the
    result is coalesced. ``hvd.synchronize(handle)`` returns the sparse result."""
    try:
        rop = C.resolve_op(None, op)
        if rop not in (ddl.Sum, ddl.Average):
            raise ddl.DDLConfigError(f"sparse_allreduce_async: op must be Sum or Average, "
                                     f"not {rop.name}")
        if not tensor.is_sparse:
            raise ddl.DDLConfigError("sparse_allreduce_async needs a sparse COO tensor")
    except Exception as exc:
        from ddl.hvd import negotiate as ng

        ng.fail_here(ng.GROUPED_ALLGATHER, exc, name or "sparse_allreduce",
                     async_=False, scope=scope(process_set))
        raise
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    inner = C.grouped_allgather([t.indices().t().contiguous(), t.values().contiguous()],
                                name=name, process_set=process_set, async_=True)
    n = scope(process_set).size if rop is ddl.Average else 0
    return _SparseHandle(inner, t, n)


# ------------------------------------------------------------------- allgather
def _allgather(tensor: torch.Tensor, name: str | None, process_set: Any, *,
               async_: bool = False) -> Any:
    return C.allgather(tensor, name=name, process_set=process_set, async_=async_)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = None) -> Handle:
    return _allgather(tensor, name, process_set, async_=True)


_offsets = C.row_offsets


class _AllgatherFn(torch.autograd.Function):
    """Horovod's allgather gradient: the Average allreduce of the gradient, of which this
    rank takes its own rows (``HorovodAllgather.backward``)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        ctx.scalar = tensor.dim() == 0
        return _allgather(tensor, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce(grad.contiguous(), None, None, ddl.Average, 1.0, 1.0,
                             Compression.none, ctx.process_set)
        (start, n), = _offsets([ctx.dim], ctx.process_set)
        out = reduced.narrow(0, start, n)
        return (out.reshape(()) if ctx.scalar else out), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """Concatenation of every rank's ``tensor`` along dimension 0 (sizes may differ).
    Differentiable, as in Horovod."""
    if _needs_grad([tensor]):
        return _AllgatherFn.apply(tensor, name, process_set)
    return _allgather(tensor, name, process_set)


def _grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None, process_set: Any,
                       *, async_: bool = False) -> Any:
    return C.grouped_allgather(tensors, name=name, process_set=process_set, async_=async_)


class _GroupedAllgatherFn(torch.autograd.Function):
    """``_AllgatherFn`` for a group: one grouped Average allreduce of the gradients, one
    allgather of the first dimensions."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.scalars = [t.dim() == 0 for t in tensors]
        ctx.process_set = process_set
        return tuple(_grouped_allgather(tensors, name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        reduced = _grouped([g.contiguous() for g in grads], None, None, ddl.Average, 1.0,
                           1.0, Compression.none, ctx.process_set)
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
    return _grouped_allgather(tensors, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = None) -> Handle:
    return _grouped_allgather(tensors, name, process_set, async_=True)


# ------------------------------------------------------------------- broadcast
def _broadcast(tensor: torch.Tensor, root_rank: int, name: str | None, process_set: Any,
               *, inplace: bool = False, async_: bool = False) -> Any:
    return C.broadcast(tensor, root_rank, name=name, inplace=inplace,
                       process_set=process_set, async_=async_)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = None) -> Handle:
    return _broadcast(tensor, root_rank, name, process_set, async_=True)


class _BroadcastFn(torch.autograd.Function):
    """Horovod's broadcast gradient (``HorovodBroadcast.backward``): the Average allreduce
    of the gradient on the root, zeros elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return _broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce(grad.contiguous(), None, None, ddl.Average, 1.0, 1.0,
                             Compression.none, ctx.process_set)
        if ddl.rank() != ctx.root:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor. Differentiable."""
    if _needs_grad([tensor]):
        return _BroadcastFn.apply(tensor, root_rank, name, process_set)
    return _broadcast(tensor, root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = None) -> Handle:
    return _broadcast(tensor, root_rank, name, process_set, inplace=True, async_=True)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = None) -> torch.Tensor:
    return _broadcast(tensor, root_rank, name, process_set, inplace=True)


broadcast_group_ = C.broadcast_group_


# ------------------------------------------------- alltoall, reduce_scatter
def _alltoall(tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any, *,
              async_: bool = False, with_splits: bool = False) -> Any:
    return C.alltoall(tensor, splits, name=name, process_set=process_set, async_=async_,
                      with_splits=with_splits)


class _AlltoallFn(torch.autograd.Function):
    """Horovod's alltoall gradient (``HorovodAlltoall.backward``): the alltoall of the
    gradient back, with the splits this rank received."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _alltoall(tensor, splits, name, process_set, with_splits=True)
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *unused):
        back, _ = _alltoall(grad.contiguous(), ctx.received, None, ctx.process_set,
                            with_splits=True)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
             name: str | None = None, process_set: Any = None) -> Any:
    """Send ``splits[j]`` rows to rank ``j``; returns the rows received (and, when
    ``splits`` is given, how many came from each rank), like Horovod. Differentiable."""
    if _needs_grad([tensor]):
        return _AlltoallFn.apply(tensor, splits, name, process_set)
    return _alltoall(tensor, splits, name, process_set)


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | None = None,
                   name: str | None = None, process_set: Any = None) -> Handle:
    return _alltoall(tensor, splits, name, process_set, async_=True)


def _reducescatter(tensors: Sequence[torch.Tensor], op: Any, name: str | None,
                   compression: type[Compressor], process_set: Any, prescale_factor: float,
                   postscale_factor: float, *, grouped: bool, async_: bool = False) -> Any:
    return C.reducescatter(tensors, op=op, name=name, compression=compression,
                           process_set=process_set, prescale=prescale_factor,
                           postscale=postscale_factor, grouped=grouped, async_=async_)


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
                             postscale, grouped=grouped)
        return tuple(out) if grouped else out

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, scale, grouped = ctx.args
        factor = scale * (scope(process_set).size if C.resolve_op(None, op) is ddl.Sum else 1)
        gathered = _grouped_allgather([g.contiguous() for g in grads], None, process_set)
        if factor != 1.0:
            gathered = [g * factor for g in gathered]
        return (None,) * 7 + tuple(gathered)


def _reducescatter_entry(tensors: Sequence[torch.Tensor], op: Any, name: str | None,
                         compression: type[Compressor], process_set: Any, prescale: float,
                         postscale: float, *, grouped: bool) -> Any:
    if _needs_grad(tensors):
        out = _ReducescatterFn.apply(op, name, compression, process_set, prescale, postscale,
                                     grouped, *tensors)
        return list(out) if grouped else out
    return _reducescatter(tensors, op, name, compression, process_set, prescale, postscale,
                          grouped=grouped)


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: Any = None,
                  process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Horovod's ``reducescatter``: the Average (or ``op``) over ranks of ``tensor``, of
    which this rank gets its block of dimension 0. Differentiable."""
    return _reducescatter_entry(_one(tensor), op, name, compression, process_set,
                                prescale_factor, postscale_factor, grouped=False)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = None,
                        process_set: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    return _reducescatter(_one(tensor), op, name, Compression.none, process_set,
                          prescale_factor, postscale_factor, grouped=False, async_=True)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: Any = None,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """``reducescatter`` of each tensor, as one call. Differentiable."""
    return _reducescatter_entry(list(tensors), op, name, compression, process_set,
                                prescale_factor, postscale_factor, grouped=True)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = None, process_set: Any = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0
                                ) -> Handle:
    return _reducescatter(list(tensors), op, name, Compression.none, process_set,
                          prescale_factor, postscale_factor, grouped=True, async_=True)


def reduce_scatter(tensor: torch.Tensor, op: Any = None, name: str | None = None,
                   process_set: Any = None) -> torch.Tensor:
    """ddl's earlier spelling of :func:`reducescatter` (``op`` first), kept as an alias."""
    return reducescatter(tensor, name=name, op=op, process_set=process_set)


def reduce_scatter_async(tensor: torch.Tensor, op: Any = None, name: str | None = None,
                         process_set: Any = None) -> Handle:
    return reducescatter_async(tensor, name=name, op=op, process_set=process_set)


# --------------------------------------------------------------- join, barrier
barrier = C.barrier


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
    """``root_rank``'s ``obj`` on every rank (pickled with ``torch.save``, tensors on any
    device included): one call, whose exchange also carries the root's payload length."""
    return C.broadcast_object(obj, root_rank, name, process_set, pickler=TorchOps)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    return C.allgather_object(obj, name, process_set, pickler=TorchOps)


shutdown_exchange = C.shutdown_exchange
