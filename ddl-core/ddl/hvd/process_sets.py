"""Horovod's process sets on ``ddl.new_group``: collectives among some of the ranks.

``hvd.add_process_set(ranks)`` is collective over every rank, in the same order
everywhere (Horovod's rule, with or without ``HOROVOD_DYNAMIC_PROCESS_SETS``); it is one
negotiated call of the global set, so ranks that disagree on the members raise together.
The members then make a ``ddl.Group`` (shared memory inside a host, a network group
across hosts), whose own queue and own identity exchange every call with
``process_set=`` runs on. Roots (``root_rank``) stay job ranks, as in Horovod; ranks
inside a set are numbered in ascending job-rank order.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

import ddl
from ddl.groups import check_ranks

from . import negotiate as ng


class ProcessSet:
    """A set of job ranks (all of them for ``global_process_set``). Registered by
    ``hvd.add_process_set`` or ``hvd.init(process_sets=[...])``."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        if ranks is not None and not isinstance(ranks, (list, tuple, range)):
            ranks = list(ranks)  # a numpy array or other iterable of ints
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id: int | None = 0 if ranks is None else None
        self._state: ng._State | None = None

    def _all(self) -> list[int]:
        return list(range(ddl.size())) if self.ranks is None else self.ranks

    def size(self) -> int:
        return len(self._all())

    def rank(self) -> int:
        """This process's rank in the set, -1 when it is not a member."""
        members = self._all()
        return members.index(ddl.rank()) if ddl.rank() in members else -1

    def included(self) -> bool:
        return ddl.rank() in self._all()

    def __repr__(self) -> str:
        # Horovod's text (its tests compare it); the global set lists every rank once ddl
        # is up, and there is no MPI communicator behind any set
        ranks = self.ranks
        if ranks is None:
            ranks = list(range(ddl.size())) if ddl.is_initialized() else None
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks}, mpi_comm=None)"


global_process_set = ProcessSet()


class _Registry:
    def __init__(self) -> None:
        self.sets: dict[int, ProcessSet] = {0: global_process_set}
        self.next_id = 1
        self.free: collections.deque[int] = collections.deque()  # removed sets' ids

    def new_id(self) -> int:
        """The id the next set gets: a removed set's, the first removed first (Horovod's
        ``ProcessSetTable`` reuses them so), else a new one; the same on every rank, since
        every rank adds and removes sets in the same order."""
        return self.free[0] if self.free else self.next_id

    def take(self, set_id: int) -> None:
        if self.free and self.free[0] == set_id:
            self.free.popleft()
        else:
            self.next_id += 1


_registry = _Registry()


def reset() -> None:
    """Forget the sets of the previous ``init()`` (their groups went with ddl.shutdown)."""
    global _registry
    for ps in _registry.sets.values():
        if ps is not global_process_set:
            ps.process_set_id, ps._state = None, None
    _registry = _Registry()


def by_id(process_set_id: int) -> ProcessSet | None:
    """The registered set with this id (0: the global one), or None."""
    return _registry.sets.get(int(process_set_id))


def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
    """Every registered set's id and ranks (the global set's: every rank), as Horovod's
    ``mpi_ops._basics._get_process_set_ids_and_ranks()`` gives them (its tests read it)."""
    return {i: ps._all() for i, ps in sorted(_registry.sets.items())}


def scope(process_set: Any) -> ng._State:
    """The protocol state a call with ``process_set=`` runs in; raises on this rank when
    the set is unknown here or does not include it (its members alone call it)."""
    if process_set is None or process_set is global_process_set:
        return ng.global_state()
    if not isinstance(process_set, ProcessSet):
        raise ddl.DDLConfigError(
            f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}")
    if process_set.ranks == list(range(ddl.size())) and process_set.process_set_id == 0:
        return ng.global_state()
    if process_set.process_set_id is None or _registry.sets.get(
            process_set.process_set_id) is not process_set:
        raise ddl.DDLConfigError(
            f"{process_set!r} is not registered: call hvd.add_process_set (on every rank) "
            "or pass it to hvd.init(process_sets=[...])")
    if process_set._state is None:
        raise ddl.DDLConfigError(
            f"rank {ddl.rank()} is not in {process_set!r}: only its members call its "
            "collectives")
    return process_set._state


def _members(ranks: list[int]) -> bytes:
    return np.asarray(ranks, dtype=np.int64).tobytes()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (collective: every rank calls it, in the same order). Returns
    the ProcessSet, with its ``process_set_id``."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)

    def plan() -> ng.Planned:
        if ps.ranks is None:
            raise ddl.DDLConfigError("add_process_set: the global process set exists already")
        members = check_ranks(ps.ranks, ddl.size())
        if ps.process_set_id is not None:
            raise ddl.DDLConfigError(f"add_process_set: {ps!r} is registered already")
        for other in _registry.sets.values():
            if other._all() == list(members):
                raise ddl.DDLConfigError(
                    f"add_process_set: a process set with ranks {list(members)} exists "
                    f"already (id {other.process_set_id})")
        set_id = _registry.new_id()
        call = ng.Call(ng.ADD_PROCESS_SET, arg=set_id, count=len(members),
                       layout=_members(list(members)))

        def data(r: np.ndarray) -> None:
            group = ddl.new_group(list(members))  # None on ranks outside the set
            _registry.take(set_id)
            ps.process_set_id = set_id
            _registry.sets[set_id] = ps
            if group is not None:
                ps._state = ng._State(group, set_id)

        return ng.Planned(call, data)

    ng.submit(ng.ADD_PROCESS_SET, None, plan, async_=False, label="add_process_set")
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set and release its group (collective over every rank).
    Returns False for the global set or a set that is not registered, as Horovod."""
    if (not isinstance(process_set, ProcessSet) or process_set is global_process_set
            or process_set.process_set_id is None
            or _registry.sets.get(process_set.process_set_id) is not process_set):
        return False
    set_id = process_set.process_set_id

    def plan() -> ng.Planned:
        call = ng.Call(ng.REMOVE_PROCESS_SET, arg=set_id)

        def data(r: np.ndarray) -> None:
            st = process_set._state
            if st is not None:
                ddl.destroy_group(st.group)
            del _registry.sets[set_id]
            _registry.free.append(set_id)
            process_set.process_set_id, process_set._state = None, None

        return ng.Planned(call, data)

    ng.submit(ng.REMOVE_PROCESS_SET, None, plan, async_=False, label="remove_process_set")
    return True


def init_sets(process_sets: Any) -> None:
    """``hvd.init(process_sets=...)``: a list of ProcessSets (or rank lists) to register
    now, or ``"dynamic"`` (sets may be added later: always true in ddl)."""
    if process_sets is None or process_sets == "dynamic":
        return
    for ps in process_sets:
        add_process_set(ps)
