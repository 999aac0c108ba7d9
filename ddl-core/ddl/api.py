"""The public, Horovod-shaped API of the ddl core (numpy arrays and torch tensors).

Each collective has one implementation (``plan_*`` in :mod:`ddl.planning`, which checks the
arguments and returns the work as a closure); the blocking, in-place and ``_async``
spellings below are thin wrappers around it. What ``init()`` makes, and the functions that
read it (``rank()``, ``malloc()``, ``new_group()``...), live in :mod:`ddl.session`; both
modules' names are re-exported here, with the internal API the framework adapters build on
(``plan_*``, :func:`dispatch`, :func:`job_engine`, :func:`session`: :mod:`ddl.hvd`,
``ddl.torch``, ``ddl.tensorflow``), which is not part of ``ddl.*``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import session as _lifecycle
from .groups import Group
from .ops import Average, ReduceOp
from .planning import (
    grouped_layout,
    issue,
    plan_allgather,
    plan_allreduce,
    plan_allreduce_into,
    plan_broadcast,
    plan_reduce_scatter,
    split_rows,
)
from .runtime import Handle
from .session import (
    Session,
    cross_rank,
    cross_size,
    destroy_group,
    dispatch,
    engine_name,
    get_options,
    in_shared_memory,
    init,
    is_initialized,
    job_engine,
    jobs_in_flight,
    local_rank,
    local_size,
    malloc,
    new_group,
    rank,
    session,
    shared_block,
    shutdown,
    size,
    target,
)

# the session's internals under the names tests and benchmarks reach for
_s, _w = _lifecycle.current, _lifecycle._w
_shm_kwargs, _show_diagnostics = _lifecycle._shm_kwargs, _lifecycle._show_diagnostics

# ------------------------------------------------------------------ the spellings
# Every public spelling of a collective is a thin ``def`` over one ``plan_*``: ``x`` blocks
# and returns a new result, ``x_`` works in place, ``x_async``/``x_async_`` return a Handle
# at once (``synchronize``/``poll``, or ``handle.wait()``). Each only names its plan.
OpArg = ReduceOp | str


def allreduce(tensor: Any, op: OpArg = Average, *, out: Any = None, name: str | None = None,
              group: Group | None = None) -> Any:
    """Reduce ``tensor`` over all ranks and return the result (a new tensor, or ``out``)."""
    return issue(lambda: plan_allreduce(tensor, op, out, inplace=False, group=group),
                 tensor, op, "allreduce", name, group, async_=False)


def allreduce_(tensor: Any, op: OpArg = Average, *, name: str | None = None,
               group: Group | None = None) -> Any:
    """In-place allreduce; returns ``tensor``."""
    return issue(lambda: plan_allreduce(tensor, op, None, inplace=True, group=group),
                 tensor, op, "allreduce_", name, group, async_=False)


def allreduce_async(tensor: Any, op: OpArg = Average, *, out: Any = None,
                    name: str | None = None, group: Group | None = None) -> Handle:
    """``allreduce``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return issue(lambda: plan_allreduce(tensor, op, out, inplace=False, group=group),
                 tensor, op, "allreduce_async", name, group, async_=True)


def allreduce_async_(tensor: Any, op: OpArg = Average, *, name: str | None = None,
                     group: Group | None = None) -> Handle:
    """``allreduce_``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return issue(lambda: plan_allreduce(tensor, op, None, inplace=True, group=group),
                 tensor, op, "allreduce_async_", name, group, async_=True)


def grouped_allreduce_(tensors: Sequence[Any], op: OpArg = Average, *, name: str | None = None,
                       group: Group | None = None) -> Any:
    """Allreduce several tensors of one dtype in place, as one fused collective: the same
    steps and bits as an allreduce of their concatenation, but no fusion buffer is filled
    (each tensor is staged from where it lives). Every rank passes the same sizes (they are
    part of the call's identity). Returns ``tensors``."""
    tensors = list(tensors)  # read once: the plan and a refusal both look at them
    return issue(lambda: plan_allreduce_into(tensors, None, op, group, grouped=True),
                 tensors, op, "grouped_allreduce_", name, group, async_=False)


def grouped_allreduce_async_(tensors: Sequence[Any], op: OpArg = Average, *,
                             name: str | None = None, group: Group | None = None) -> Handle:
    """``grouped_allreduce_``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    tensors = list(tensors)
    return issue(lambda: plan_allreduce_into(tensors, None, op, group, grouped=True),
                 tensors, op, "grouped_allreduce_async_", name, group, async_=True)


def allgather(tensor: Any, *, name: str | None = None, group: Group | None = None) -> Any:
    """Concatenate every rank's tensor along dimension 0 (first dimensions may differ)."""
    return issue(lambda: plan_allgather(tensor, group), tensor, None, "allgather", name,
                 group, async_=False)


def allgather_async(tensor: Any, *, name: str | None = None,
                    group: Group | None = None) -> Handle:
    """``allgather``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return issue(lambda: plan_allgather(tensor, group), tensor, None, "allgather_async", name,
                 group, async_=True)


def broadcast(tensor: Any, root_rank: int = 0, *, name: str | None = None,
              group: Group | None = None) -> Any:
    """Return a copy of ``root_rank``'s tensor on every rank."""
    return issue(lambda: plan_broadcast(tensor, root_rank, inplace=False, group=group),
                 tensor, None, "broadcast", name, group, async_=False)


def broadcast_(tensor: Any, root_rank: int = 0, *, name: str | None = None,
               group: Group | None = None) -> Any:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns ``tensor``."""
    return issue(lambda: plan_broadcast(tensor, root_rank, inplace=True, group=group),
                 tensor, None, "broadcast_", name, group, async_=False)


def broadcast_async(tensor: Any, root_rank: int = 0, *, name: str | None = None,
                    group: Group | None = None) -> Handle:
    """``broadcast``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return issue(lambda: plan_broadcast(tensor, root_rank, inplace=False, group=group),
                 tensor, None, "broadcast_async", name, group, async_=True)


def broadcast_async_(tensor: Any, root_rank: int = 0, *, name: str | None = None,
                     group: Group | None = None) -> Handle:
    """``broadcast_``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return issue(lambda: plan_broadcast(tensor, root_rank, inplace=True, group=group),
                 tensor, None, "broadcast_async_", name, group, async_=True)


def reduce_scatter(tensor: Any, op: OpArg = Average, *, name: str | None = None,
                   group: Group | None = None) -> Any:
    """Reduce over ranks, then return this rank's block of dimension 0 (``split_rows``)."""
    return issue(lambda: plan_reduce_scatter(tensor, op, group), tensor, op, "reduce_scatter",
                 name, group, async_=False)


def reduce_scatter_async(tensor: Any, op: OpArg = Average, *, name: str | None = None,
                         group: Group | None = None) -> Handle:
    """``reduce_scatter``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return issue(lambda: plan_reduce_scatter(tensor, op, group), tensor, op,
                 "reduce_scatter_async", name, group, async_=True)


# The public spellings of the collectives, blocking ones first then their queued twins.
SPELLINGS: tuple[Callable[..., Any], ...] = (
    allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce_,
    grouped_allreduce_async_, allgather, allgather_async, broadcast, broadcast_,
    broadcast_async, broadcast_async_, reduce_scatter, reduce_scatter_async)


def barrier(*, group: Group | None = None) -> None:
    engine, _, _ = target(group)
    dispatch(engine.barrier, "barrier", async_=False, group=group)


def synchronize(handle: Handle) -> Any:
    """Wait for an ``*_async`` operation and return its result (raises its error)."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when the ``*_async`` operation has finished."""
    return handle.poll()


__all__ = [
    # the session (ddl.session)
    "Session", "cross_rank", "cross_size", "destroy_group", "dispatch", "engine_name",
    "get_options", "in_shared_memory", "init", "is_initialized", "job_engine",
    "jobs_in_flight", "local_rank", "local_size", "malloc", "new_group", "rank", "session",
    "shared_block", "shutdown", "size",
    # the planning (ddl.planning)
    "grouped_layout", "plan_allgather", "plan_allreduce", "plan_allreduce_into",
    "plan_broadcast", "plan_reduce_scatter", "split_rows",
    # defined here: the spellings (SPELLINGS), barrier and the handles' functions
    "OpArg", "SPELLINGS", "allgather", "allgather_async", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "grouped_allreduce_", "grouped_allreduce_async_",
    "poll", "reduce_scatter", "reduce_scatter_async", "synchronize",
]
