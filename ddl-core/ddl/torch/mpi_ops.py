"""Horovod's ``horovod.torch`` collectives, with Horovod's arguments, over the ddl core.

Each collective is one function over the core's async call; the blocking and in-place
spellings wrap it. Handles are ddl handles (``wait()``/``poll()``), so ``hvd.synchronize``
and ``ddl.synchronize`` both take them.

Every collective here goes through :mod:`ddl.torch.join`: a small control exchange, queued
with its data, lets ranks that called ``join()`` serve the others (Horovod's semantics) and
turns ranks calling different collectives into one clear error on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import ddl
from ddl.ops import parse_op

from . import collectives
from .compression import Compression, Compressor
from .join import (
    Ready as _Ready,
)
from .join import (
    check_object_collective,
    run_alltoall,
    run_barrier,
    submit_allgather,
    submit_allreduce,
    submit_broadcast,
    submit_reduce_scatter,
)
from .join import join as _join


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


class Handle:
    """An async result that post-processes on ``wait()`` (scaling, decompression, copies)."""

    __slots__ = ("_inner", "_finish", "_done", "_value", "name")

    def __init__(self, inner: Any, finish: Callable[[Any], Any] | None = None,
                 name: str = "") -> None:
        self._inner, self._finish, self.name = inner, finish, name
        self._done, self._value = False, None

    def poll(self) -> bool:
        return self._done or self._inner.poll()

    def wait(self) -> Any:
        if not self._done:
            value = self._inner.wait()
            self._value = self._finish(value) if self._finish else value
            self._done = True
        return self._value

    def __repr__(self) -> str:
        return f"<ddl.torch.Handle {self.name or '?'} {'done' if self.poll() else 'pending'}>"


def synchronize(handle: Any) -> Any:
    """Wait for an ``*_async`` call and return its output."""
    return handle.wait()


def poll(handle: Any) -> bool:
    """True when the ``*_async`` call has finished."""
    return handle.poll()


def _op(average: bool | None, op: Any) -> ddl.ReduceOp:
    if average is not None:
        if op is not None:
            raise ValueError("pass op or average (deprecated), not both")
        return ddl.Average if average else ddl.Sum
    if op is None:
        return ddl.Average
    if isinstance(op, str) and op.lower() == "adasum":
        raise NotImplementedError("ddl.torch: Adasum is not implemented; use op=hvd.Average")
    return parse_op(op)


# ------------------------------------------------------------------- allreduce
def _allreduce_async(tensor: torch.Tensor, average, name, op, prescale_factor: float,
                     postscale_factor: float, compression: type[Compressor], inplace: bool,
                     process_set: Any, async_: bool = True) -> Handle:
    """``async_=False`` (the blocking spellings) runs on the caller's thread when nothing
    is queued, like the core's blocking calls: no hand-off to the worker thread."""
    _check_process_set(process_set)
    rop = _op(average, op)
    sent, ctx = compression.compress(tensor)
    if prescale_factor != 1.0:
        sent = sent * prescale_factor
    # In place whenever the tensor sent is ours to overwrite: the caller's own for the
    # in-place spellings, or a temporary made by compression or prescaling. Out of place
    # would allocate a fresh result (page faults on every call for large tensors) and copy.
    inner = submit_allreduce(sent, rop, name=name or "allreduce", prescale=prescale_factor,
                             postscale=postscale_factor, async_=async_,
                             inplace=inplace or sent is not tensor)
    if not async_:
        inner = _Ready(inner)

    def finish(out: torch.Tensor) -> torch.Tensor:
        if postscale_factor != 1.0:
            out.mul_(postscale_factor)
        out = compression.decompress(out, ctx)
        if inplace:
            if out is not tensor:
                with torch.no_grad():
                    tensor.copy_(out)
            return tensor
        return out

    return Handle(inner, finish, name or "allreduce")


class _AllreduceFn(torch.autograd.Function):
    """Horovod's allreduce is differentiable: the gradient is the allreduce of the gradient."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, compression, name):
        ctx.args = (op, prescale, postscale, compression)
        return _allreduce_async(tensor, None, name, op, prescale, postscale, compression,
                                False, None, False).wait()

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, compression = ctx.args
        out = _allreduce_async(grad.contiguous(), None, None, op, prescale, postscale,
                               compression, False, None, False).wait()
        return out, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """Average (or ``op``) of ``tensor`` over all ranks, as a new tensor."""
    rop = _op(average, op)
    _check_process_set(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllreduceFn.apply(tensor, rop, prescale_factor, postscale_factor, compression,
                                  name)
    return _allreduce_async(tensor, None, name, rop, prescale_factor, postscale_factor,
                            compression, False, None, False).wait()


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                            Compression.none, False, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> torch.Tensor:
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                            Compression.none, True, process_set, False).wait()


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                            Compression.none, True, process_set)


def _grouped_async(tensors: Sequence[torch.Tensor], average, name, op, prescale_factor,
                   postscale_factor, compression, inplace: bool, process_set) -> Handle:
    """One fused allreduce per (dtype, device): Horovod's grouped_allreduce fuses too."""
    _check_process_set(process_set)
    rop = _op(average, op)
    sent = [compression.compress(t) for t in tensors]
    by_key: dict[tuple, list[int]] = {}
    for i, (s, _) in enumerate(sent):
        by_key.setdefault((s.dtype, s.device), []).append(i)
    parts = []
    direct = inplace and compression is Compression.none and prescale_factor == 1.0
    for (dtype, device), idx in by_key.items():
        if direct and device.type == "cpu":
            # reduced where they live, as one fused collective: nothing is packed
            group = [tensors[i] for i in idx]
            numel = sum(t.numel() for t in group)
            stand_in = torch.empty(numel, dtype=dtype, device="meta")  # the fused shape
            parts.append((idx, False, submit_allreduce(
                stand_in, rop, name=name or "grouped_allreduce", inplace=True,
                postscale=postscale_factor, sources=group)))
            continue
        flat = torch.cat([sent[i][0].reshape(-1) for i in idx])
        if prescale_factor != 1.0:
            flat.mul_(prescale_factor)
        parts.append((idx, True, submit_allreduce(flat, rop, name=name or "grouped_allreduce",
                                                  inplace=True, prescale=prescale_factor,
                                                  postscale=postscale_factor)))

    def finish(_: Any) -> list[torch.Tensor]:
        out: list[Any] = [None] * len(tensors)
        for idx, packed, h in parts:
            flat = h.wait()
            if not packed:  # reduced in place, where the tensors live
                for i in idx:
                    if postscale_factor != 1.0:
                        with torch.no_grad():
                            tensors[i].mul_(postscale_factor)
                    out[i] = tensors[i]
                continue
            if postscale_factor != 1.0:
                flat.mul_(postscale_factor)
            off = 0
            for i in idx:
                n = tensors[i].numel()
                r = compression.decompress(flat[off:off + n].view(tensors[i].shape), sent[i][1])
                off += n
                if inplace:
                    with torch.no_grad():
                        tensors[i].copy_(r)
                    r = tensors[i]
                out[i] = r
        return out

    last = parts[-1][2] if parts else _Ready(None)
    return Handle(last, finish, name or "grouped_allreduce")


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None
                      ) -> list[torch.Tensor]:
    return _grouped_async(tensors, average, name, op, prescale_factor, postscale_factor,
                          compression, False, process_set).wait()


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> Handle:
    return _grouped_async(tensors, average, name, op, prescale_factor, postscale_factor,
                          Compression.none, False, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None
                       ) -> list[torch.Tensor]:
    return _grouped_async(tensors, average, name, op, prescale_factor, postscale_factor,
                          Compression.none, True, process_set).wait()


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> Handle:
    return _grouped_async(tensors, average, name, op, prescale_factor, postscale_factor,
                          Compression.none, True, process_set)


# ------------------------------------------------------- allgather, broadcast
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = None) -> Any:
    _check_process_set(process_set)
    return submit_allgather(tensor if tensor.dim() else tensor.reshape(1),
                            name=name or "allgather")


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """Concatenation of every rank's ``tensor`` along dimension 0 (sizes may differ)."""
    _check_process_set(process_set)
    return submit_allgather(tensor if tensor.dim() else tensor.reshape(1),
                            name=name or "allgather", async_=False)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[torch.Tensor]:
    handles = [allgather_async(t, name, process_set) for t in tensors]
    return [h.wait() for h in handles]


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = None) -> Any:
    _check_process_set(process_set)
    return submit_broadcast(tensor, root_rank, name=name or "broadcast")


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    _check_process_set(process_set)
    return submit_broadcast(tensor, root_rank, name=name or "broadcast", async_=False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = None) -> Any:
    _check_process_set(process_set)
    return submit_broadcast(tensor, root_rank, name=name or "broadcast_", inplace=True)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = None) -> torch.Tensor:
    _check_process_set(process_set)
    return submit_broadcast(tensor, root_rank, name=name or "broadcast_", inplace=True,
                            async_=False)


# ------------------------------------------------- alltoall, reduce_scatter
def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
             name: str | None = None, process_set: Any = None) -> Any:
    """Send ``splits[j]`` rows to rank ``j``; returns the rows received (and, when
    ``splits`` is given, how many came from each rank), like Horovod."""
    _check_process_set(process_set)
    s = None if splits is None else [int(x) for x in (
        splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    rows = tensor.shape[0] if tensor.dim() else 1
    send = collectives.alltoall_splits(rows, s)
    table, data = run_alltoall(tensor, send, name=name or "alltoall")
    out, received = collectives.alltoall_receive(table, data, tuple(tensor.shape[1:]))
    return out if splits is None else (out, received)


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | None = None,
                   name: str | None = None, process_set: Any = None) -> Any:
    return _Ready(alltoall(tensor, splits, name, process_set))


def reduce_scatter(tensor: torch.Tensor, op: Any = None, name: str | None = None,
                   process_set: Any = None) -> torch.Tensor:
    """Reduce over ranks, then this rank's block of dimension 0 (``ddl.split_rows``)."""
    _check_process_set(process_set)
    return submit_reduce_scatter(tensor, _op(None, op), name=name or "reduce_scatter",
                                 async_=False)


def reduce_scatter_async(tensor: torch.Tensor, op: Any = None, name: str | None = None,
                         process_set: Any = None) -> Any:
    _check_process_set(process_set)
    return submit_reduce_scatter(tensor, _op(None, op), name=name or "reduce_scatter_async")


# --------------------------------------------------------------- join, barrier
def barrier(process_set: Any = None) -> None:
    _check_process_set(process_set)
    run_barrier()


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
    _check_process_set(process_set)
    check_object_collective("broadcast_object", root_rank)
    return collectives.broadcast_object(obj, root_rank)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    _check_process_set(process_set)
    check_object_collective("allgather_object")
    return collectives.allgather_object(obj)
