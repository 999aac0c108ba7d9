"""What an engine is: the interfaces every engine and network group of ddl implements.

They are ``typing.Protocol`` s, implemented structurally (no engine inherits from them):

- ``Engine``: the host engines (``LocalEngine``, ``ShmEngine``, ``DimsEngine`` and its
  ``MultiHostEngine``), collectives on flat numpy arrays: all that ``ddl.planning`` and
  ``ddl.new_group``'s groups use of an engine (the session and ``new_group`` ask a
  ``MultiHostEngine``, by its type, for its network context).
- ``IdentityFold``: the optional capability of carrying a Horovod-level call's identity in
  the first step of the next collective (shared memory, and across hosts the identity
  round); ``hvd/negotiate.py`` asks for it with ``identity_fold(engine)``.
- ``PeerGroup`` and ``PeerContext``: the network groups under the multi-dimensional engine
  (``GlooGroup``, ``MPIGroup``: raw bytes and native collectives) and what makes them.
- ``TensorEngine``: the device engine (``DeviceEngine``: torch tensors, NCCL).

Every rank calls an engine's collectives in the same order with matching arguments (the
engines check that: ``DDLMismatchError`` where they differ). Ranks are the engine's own,
``0 .. size - 1``: a group's or a grid line's, not the job's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..dtypes import DType
from ..ops import ReduceOp
from ..tensors import Pieces
from .heap import Heap
from .shm_meta import Fold


@runtime_checkable
class Engine(Protocol):
    """Collectives among ``size`` ranks on host memory (flat numpy arrays of ``dt.storage``).

    ``shape`` is the caller's tensor shape: it is part of the call's identity, compared
    across ranks with the op, the dtype and the element count (``planning.grouped_layout``
    gives a grouped allreduce's); it never changes what moves."""

    name: str  # what ddl.engine_name() reports: "local", "shm", "ddl/gloo", "ddl/mpi"
    rank: int  # this process's rank among the engine's ranks
    size: int
    heap: Heap | None  # this rank's shared heap (ddl.malloc), None where peers cannot map it

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def refuse(self) -> None:
        """Take the place of a call this rank refused before its data moved
        (``planning._planned``): a step no collective matches, so that peers running the
        call raise ``DDLMismatchError`` and peers that refused it too pass."""

    def allreduce(self, src: np.ndarray | Pieces, dst: np.ndarray | Pieces, dt: DType,
                  op: ReduceOp, shape: tuple[int, ...]) -> None:
        """``dst`` = ``op`` over the ranks of ``src`` (``src.size`` elements each). ``dst``
        is ``src`` itself (in place) or does not overlap it. Either may be the ``Pieces`` of
        a fusion buffer that is never filled: several arrays read or written as one."""

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, dt: DType, op: ReduceOp,
                       shape: tuple[int, ...], counts: list[int]) -> None:
        """``dst`` (``counts[rank]`` elements) = this rank's block of ``op`` over the ranks
        of ``src``: the block at ``sum(counts[:rank])``. ``counts`` sums to ``src.size``."""

    def allgather(self, src: np.ndarray, dt: DType, row_shape: tuple[int, ...],
                  alloc: Callable[[list[int]], np.ndarray]) -> np.ndarray:
        """Concatenate every rank's ``src`` in rank order (rows of ``row_shape``; ranks may
        give different numbers of rows). ``alloc(counts)``, called once with every rank's
        element count, returns the flat output, which is filled and returned."""

    def broadcast(self, buf: np.ndarray, dt: DType, root: int, shape: tuple[int, ...]
                  ) -> None:
        """``buf`` on every rank = ``buf`` on rank ``root``, in place."""

    def close(self) -> None:
        """Release what the engine holds (segments, groups); after queued work finished."""


@runtime_checkable
class IdentityFold(Protocol):
    """The optional capability of an ``Engine`` to carry a call identity (a Horovod-level
    descriptor, ``hvd/negotiate.py``) in the first step of its next collective, instead of
    an exchange of its own before the data moves."""

    armed: Fold | None  # the fold the next collective carries, until one takes it

    def fold_identity(self, fold: Fold) -> None:
        """Carry ``fold``'s descriptor in the next collective; that collective raises
        ``Unfolded`` (with every rank's MAX) where its data must not move."""

    def cancel_fold(self) -> Fold | None:
        """Disarm a fold no collective took (the call moved no data here); returns it."""

    def exchange_identity(self, desc: np.ndarray) -> np.ndarray:
        """The MAX of every rank's ``desc`` (int64), in place, in a step of its own that
        meets the peers' folded ones."""


# type -> whether its instances fold: a runtime_checkable isinstance costs ~10 µs on
# Python 3.11, a dict lookup well under one, and the question is asked per call.
_FOLDS: dict[type, bool] = {}


def identity_fold(engine: object) -> IdentityFold | None:
    """``engine`` when it has the ``IdentityFold`` capability, else None."""
    cls = type(engine)
    folds = _FOLDS.get(cls)
    if folds is None:
        folds = _FOLDS[cls] = isinstance(engine, IdentityFold)
    return engine if folds else None  # type: ignore[return-value]


@runtime_checkable
class PeerGroup(Protocol):
    """A network group (Gloo, MPI) of ``size`` ranks: a dimension of the multi-dimensional
    engine across hosts, or its group of every member. Ranks are the group's."""

    name: str  # the transport: "gloo", "mpi"
    rank: int
    size: int

    def native_ok(self, dt: DType) -> bool:
        """Whether ``allreduce`` reduces ``dt`` natively (else DDL's algorithms reduce it
        over ``sendrecv``)."""

    def sendrecv(self, send: np.ndarray, to: int, recv: np.ndarray, frm: int) -> None:
        """Send the bytes of ``send`` to rank ``to`` while receiving ``recv`` (its byte
        count) from rank ``frm``; either may be empty."""

    def allreduce(self, buf: np.ndarray, dt: DType, op: ReduceOp) -> None:
        """The transport's own allreduce, in place; Average divides after the sum."""

    def broadcast(self, buf: np.ndarray, dt: DType, root: int) -> None:
        """``buf`` on every rank = ``buf`` on rank ``root``, in place."""

    def allgather_bytes(self, src: np.ndarray, dst: np.ndarray) -> None:
        """``dst`` = the bytes of every rank's ``src`` (one size on all), in rank order."""

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def close(self) -> None:
        """Release the group; safe to call more than once."""


@runtime_checkable
class PeerContext(Protocol):
    """What a multi-host job makes its network groups from (``GlooContext``,
    ``MPIContext``); the groups are made by their members only."""

    def group(self, name: str, members: tuple[int, ...], position: int) -> PeerGroup:
        """The group of global ranks ``members`` (this process is ``members[position]``),
        named alike on every member."""

    def subgroup(self, name: str, members: tuple[int, ...], position: int,
                 timeout: float) -> PeerGroup:
        """``group`` for ``ddl.new_group``, waiting up to ``timeout`` for the members."""

    def close(self) -> None:
        """Leave what the context joined (the rendezvous it opened itself)."""


@runtime_checkable
class TensorEngine(Protocol):
    """Collectives on torch tensors of one device type (``DeviceEngine``: NCCL, or Gloo on
    CPU tensors), in place unless an output is given. Ranks are the job's."""

    name: str

    def describe(self) -> str:
        """The dimensions it runs over, for ``-dbg_level``."""

    def allreduce(self, t: Any, op: ReduceOp) -> None:
        """In place on contiguous ``t``."""

    def reduce_scatter(self, t: Any, out: Any, op: ReduceOp, counts: list[int]) -> None:
        """``out`` = this rank's block (``counts``, elements) of the reduction of flat ``t``."""

    def allgather(self, t: Any, alloc: Callable[[list[int]], Any]) -> Any:
        """Every rank's flat ``t`` concatenated into ``alloc(counts)``, which is returned."""

    def broadcast(self, t: Any, root: int) -> None:
        """``t`` on every rank = ``t`` on rank ``root``, in place."""

    def close(self) -> None:
        """Release the process groups."""
