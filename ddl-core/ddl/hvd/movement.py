"""The Horovod collectives that move tensors without reducing them: allgather (and the row
offsets its gradients need), broadcast (one tensor, or a group in place), alltoall (with
its split rule and the receiving side, which ``ddl.torch``'s ProcessGroup shares). Each is
one plan handed to :func:`ddl.hvd.named.submit`, as in :mod:`ddl.hvd.collectives`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import ddl
from ddl import api as _api

from . import negotiate as ng
from .arguments import check_root, members_layout, ops_of, without_row
from .arrays import ops_for
from .named import submit
from .negotiate import Call, Planned, code_of
from .process_sets import scope


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
                       without_row(data))

    return submit(ng.ALLGATHER, name, plan, async_=async_, label=name or "allgather",
                  scope=st)


def grouped_allgather(tensors: Sequence[Any], *, name: str | None = None,
                      process_set: Any = None, async_: bool = False) -> Any:
    """``allgather`` of each tensor, as one call (one descriptor for every member)."""
    st = scope(process_set)

    def plan() -> Planned:
        fw = ops_of(list(tensors))
        ts = [_at_least_1d(fw, t) for t in tensors]
        steps = [_api.plan_allgather(t, st.group) for t in ts]
        call = Call(ng.GROUPED_ALLGATHER, name=name, count=len(ts),
                    ndim=max((fw.ndim(t) for t in ts), default=0),
                    layout=members_layout(fw, ts, True))
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
    """``root_rank``'s ``tensor`` on every rank of the process set (into ``tensor`` itself
    when ``inplace``)."""
    st = scope(process_set)

    def plan() -> Planned:
        root, local = check_root(root_rank, st)
        data = _api.plan_broadcast(tensor, local, inplace=inplace, group=st.group)
        call = Call(ng.BROADCAST, code=code_of(tensor), shape=tuple(tensor.shape), arg=root,
                    name=name)
        return Planned(call, without_row(data))

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
        fw = ops_of(ts)
        steps = [_api.plan_broadcast(t, local, inplace=True, group=st.group) for t in ts]
        call = Call(ng.GROUPED_BROADCAST, arg=root, name=name, count=len(ts),
                    numel=sum(fw.numel(t) for t in ts),
                    ndim=max((fw.ndim(t) for t in ts), default=0),
                    layout=members_layout(fw, ts, False))
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


__all__ = ["allgather", "alltoall", "alltoall_receive", "alltoall_splits", "broadcast",
           "broadcast_group_", "grouped_allgather", "row_offsets"]
