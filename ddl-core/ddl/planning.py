"""The planning of each collective: ``plan_*`` checks the arguments and returns the work as
a closure, which ``ddl.session.dispatch`` queues; a call planning refuses still takes its
place among the peers' collectives (``_planned``). The public spellings in :mod:`ddl.api`
and the adapters (:mod:`ddl.hvd`, ``ddl.torch``, ``ddl.tensorflow``) build on these.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from . import flight as _flight
from . import grid, tensors
from .devices import DeviceRouter
from .errors import DDLConfigError, DDLError, DDLMismatchError
from .groups import Group
from .ops import ReduceOp, check_op, parse_op
from .session import current, dispatch, session, target


def _routed(tensor: Any, group: Group | None, op: ReduceOp | None = None
            ) -> tuple[DeviceRouter, str] | None:
    """(router, backend) when a device engine takes ``tensor`` (torch CUDA tensors, in
    job-wide calls only: a group's calls stage through its host engine), else None."""
    if group is not None:
        return None
    devices = current().devices
    backend = devices.backend_for(tensor, op)
    return (devices, backend) if backend else None


def _output(f: tensors.Flat, out: Any, inplace: bool, what: str) -> tuple[Any, tensors.Flat]:
    if inplace:
        return f.original, tensors.writable(f, what)
    if out is None:
        return tensors.empty_like(f)
    g = tensors.writable(tensors.flatten(out, name="out"), what, "out")
    if g.dtype is not f.dtype or g.array.size != f.array.size:
        raise DDLConfigError(
            f"{what}: out has {g.dtype.name}[{g.array.size}] but the input is "
            f"{f.dtype.name}[{f.array.size}]"
        )
    return out, g


def plan_allreduce(tensor: Any, op: Any, out: Any = None, *, inplace: bool = False,
                   group: Group | None = None) -> Callable[[], Any]:
    """``tensor`` reduced with ``op`` into ``out`` (a new tensor when None), or in place."""
    engine, _, _ = target(group)
    op = parse_op(op)
    if tensor.__class__ is not np.ndarray and (route := _routed(tensor, group, op)):
        devices, backend = route
        return devices.plan_allreduce(backend, tensor, op, out, inplace)
    f = tensors.flatten(tensor)
    check_op(op, f.dtype)
    result, g = _output(f, out, inplace, "allreduce")
    src = f.array
    if not inplace and tensors.overlaps(src, g.array) and not tensors.same_memory(src, g.array):
        src = src.copy()

    def job():
        engine.allreduce(src, g.array, f.dtype, op, f.shape)
        g.write_back()
        return result

    return job


def plan_allreduce_into(sources: list, out: Any, op: Any, group: Group | None = None, *,
                        grouped: bool = False) -> Callable[[], Any]:
    """Allreduce the concatenation of ``sources`` (flattened, one dtype, CPU) into ``out``
    (a flat contiguous CPU buffer), or in place on the sources when ``out`` is None: a fused
    allreduce whose fusion buffer is never filled. The same bits, and the same steps on the
    wire, as an allreduce of the filled buffer, which a rank that joined (Horovod's join)
    runs instead; ``grouped``: the call is a grouped allreduce of these tensors, and their
    sizes are part of its identity (``grouped_layout``), so ranks that split the same total
    differently raise ``DDLMismatchError`` instead of reducing unrelated elements."""
    engine, _, _ = target(group)
    op = parse_op(op)
    if not sources:
        raise DDLConfigError("fused allreduce of no tensors")
    if route := _routed(sources[0], group, op):
        devices, backend = route
        return devices.plan_fused_allreduce(backend, sources, out, op)
    parts = [tensors.flatten(t) for t in sources]
    dt, total = parts[0].dtype, sum(f.array.size for f in parts)
    check_op(op, dt)
    src = tensors.Pieces([f.array for f in parts])
    if out is None:
        for f in parts:
            tensors.writable(f, "fused allreduce")
        g, dst = None, src
        spans = sorted((f.array.__array_interface__["data"][0], f.array.nbytes) for f in parts)
        if any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:])):
            raise DDLConfigError("fused allreduce in place: two of the tensors share memory")
    else:
        g = tensors.writable(tensors.flatten(out, name="out"), "fused allreduce", "out")
        if g.staged:
            raise DDLConfigError("fused allreduce: out must be a contiguous CPU tensor or array")
        dst = g.array
    if any(f.dtype != dt for f in parts) or (g is not None and (g.dtype != dt
                                                                or g.array.size != total)):
        got = ", ".join(f"{f.dtype.name}[{f.array.size}]" for f in parts)
        into = f" into {g.dtype.name}[{g.array.size}]" if g is not None else ""
        raise DDLConfigError(f"fused allreduce of {got}{into}: dtypes or sizes differ")
    if g is not None:
        base = dst.__array_interface__["data"][0]
        for f, at in zip(parts, src.starts):
            # a source may already be its own slice of out (a gradient accumulated in place)
            if (tensors.overlaps(f.array, dst)
                    and f.array.__array_interface__["data"][0] - base != at * dt.itemsize):
                raise DDLConfigError("fused allreduce: a source overlaps out somewhere other "
                                     "than its own place in it")

    shape = grouped_layout([f.array.size for f in parts]) if grouped else (total,)

    def job():
        engine.allreduce(src, dst, dt, op, shape)
        if g is not None:
            return out
        for f in parts:
            f.write_back()
        return sources

    return job


def grouped_layout(sizes: list[int]) -> tuple[int, ...]:
    """The shape a grouped allreduce of tensors of ``sizes`` elements shows the engines'
    identity checks: ``(-len(sizes), *sizes)``. No tensor has a negative dimension, so it
    never equals a plain allreduce's shape, nor another split of the same total."""
    return (-len(sizes), *sizes)


def _rows_of(shape: tuple[int, ...], what: str) -> tuple[int, tuple[int, ...], int]:
    if not shape:
        raise DDLConfigError(f"{what} needs a tensor with at least one dimension, got a 0-d one")
    row_shape = tuple(shape[1:])
    row = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
    return shape[0], row_shape, row


def plan_allgather(tensor: Any, group: Group | None = None) -> Callable[[], Any]:
    """Every rank's ``tensor`` concatenated along dimension 0, in a new tensor."""
    engine, _, _ = target(group)
    if route := _routed(tensor, group):
        devices, backend = route
        _, row_shape, row = _rows_of(tuple(tensor.shape), "allgather")
        return devices.plan_allgather(backend, tensor, row_shape, row)
    f = tensors.flatten(tensor)
    _, row_shape, row = _rows_of(f.shape, "allgather")
    holder: list[Any] = []

    def alloc(counts: list[int]) -> np.ndarray:
        total = sum(counts)
        if row and any(c % row for c in counts):  # pragma: no cover - shapes are checked
            raise DDLError("allgather: element counts are not whole rows")
        obj, g = tensors.empty_like(f, (total // row if row else 0,) + row_shape)
        holder.append((obj, g))
        return g.array

    def job():
        engine.allgather(f.array, f.dtype, row_shape, alloc)
        obj, g = holder[0]
        g.write_back()
        return obj

    return job


def plan_broadcast(tensor: Any, root_rank: int, *, inplace: bool = False,
                   group: Group | None = None) -> Callable[[], Any]:
    """``root_rank``'s ``tensor`` on every rank: a new tensor, or in place."""
    engine, _, size = target(group)
    try:
        root_rank = operator.index(root_rank)  # an int, numpy's too; not a float or a str
    except TypeError:
        raise DDLConfigError(f"broadcast: root_rank must be an int, got {root_rank!r}") from None
    if not 0 <= root_rank < size:
        raise DDLConfigError(f"broadcast: root_rank {root_rank} is outside 0..{size - 1}")
    if route := _routed(tensor, group):
        devices, backend = route
        return devices.plan_broadcast(backend, tensor, root_rank, inplace)
    f = tensors.flatten(tensor)
    if inplace:
        result, g = f.original, tensors.writable(f, "broadcast")
    else:
        result, g = tensors.empty_like(f)
        np.copyto(g.array, f.array)

    def job():
        engine.broadcast(g.array, f.dtype, root_rank, f.shape)
        g.write_back()
        return result

    return job


def split_rows(rows: int, n: int) -> list[int]:
    """How reduce_scatter splits dimension 0: as evenly as possible, lower ranks first."""
    return grid.even_split(rows, n)


def plan_reduce_scatter(tensor: Any, op: Any, group: Group | None = None
                        ) -> Callable[[], Any]:
    """This rank's block (``split_rows``) of ``tensor`` reduced with ``op``, a new tensor."""
    engine, rank, size = target(group)
    op = parse_op(op)
    if route := _routed(tensor, group, op):
        devices, backend = route
        rows, row_shape, row = _rows_of(tuple(tensor.shape), "reduce_scatter")
        split = split_rows(rows, size)
        return devices.plan_reduce_scatter(backend, tensor, op, [c * row for c in split],
                                            (split[rank],) + row_shape)
    f = tensors.flatten(tensor)
    check_op(op, f.dtype)
    rows, row_shape, row = _rows_of(f.shape, "reduce_scatter")
    split = split_rows(rows, size)
    counts = [c * row for c in split]
    result, g = tensors.empty_like(f, (split[rank],) + row_shape)

    def job():
        engine.reduce_scatter(f.array, g.array, f.dtype, op, f.shape, counts)
        g.write_back()
        return result

    return job


def _planned(make: Callable[[], Callable[[], Any]], tensor: Any, op: Any, name: str,
             group: Group | None) -> Callable[[], Any]:
    """``make()``'s plan. When planning refuses the call on this rank (an op the dtype does
    not allow, an ``out`` of the wrong size, a root outside the group...), the refusal still
    takes the call's place among the peers' collectives before it is raised: the engine's
    ``refuse`` step, whose record no collective has, queued behind this rank's earlier
    work. Peers that ran the call then raise ``DDLMismatchError`` instead of pairing with
    this rank's next call (which gave every later call the wrong partner, silently); peers
    that refused too meet the step and raise their own error. Device-routed calls (NCCL)
    have no such step."""
    try:
        return make()
    except Exception as exc:  # planning has no side effects: any refusal is one
        _refuse_collectively(exc, tensor, op, name, group)
        raise


def _refuse_collectively(exc: Exception, tensor: Any, op: Any, name: str,
                         group: Group | None) -> None:
    if session() is None:
        return  # not initialized: there are no peers yet
    try:
        engine, rank, size = target(group)
    except DDLError:  # a released group, a foreign object: it has no peers to meet
        return
    try:  # where the plan would have sent it: a device engine's call has no refusal step
        first = tensor[0] if isinstance(tensor, list) and tensor else tensor
        routed = _routed(first, group, parse_op(op) if op is not None else None) is not None
    except Exception:  # noqa: BLE001 - not a tensor, not an op: the host engine's call
        routed = False
    if size < 2 or routed:
        return
    try:
        dispatch(engine.refuse, name, async_=False, group=group)
    except DDLMismatchError:
        exc.add_note(f"rank {rank}: the other ranks ran {name} and were told (each raises "
                     "DDLMismatchError)")
    except DDLError as other:
        exc.add_note(f"rank {rank}: telling the other ranks failed too: {other}")


def issue(make: Callable[[], Callable[[], Any]], first: Any, op: Any, label: str,
          name: str | None, group: Group | None, *, async_: bool) -> Any:
    """Queue ``make()``'s plan as ``name`` (default: the spelling's ``label``): a public
    spelling of a collective (``ddl.api``) is this call naming its plan; ``first`` (the
    tensor, or the first of a list) and ``op`` tell a refusal where the call would go."""
    label = name or label
    job = _planned(make, first, op, label, group)
    what = None
    if _flight.ring is not None:
        try:
            what = (first.dtype, first.shape, op)
        except AttributeError:  # not a tensor: the recorder shows the name alone
            pass
    return dispatch(job, label, async_=async_, group=group, what=what)

