"""Call identities across hosts: the first message of a call on the multi-dimensional
engine carries its identity (ddl.hvd.negotiate), and a small allreduce's data with it.

A Horovod-level call on a job that spans hosts takes one *identity round* before any of its
data crosses a host boundary, whatever the call and whatever happened on this rank:

1. inside the host, the call's first shared-memory step carries the identity as on one
   host (``ShmEngine.fold_identity``): every local rank learns whether the host's ranks
   agree, and the MAX of their descriptors; a small allreduce (``FOLD_BYTES`` or less)
   also reduces its data among them in that step, into a private buffer;
2. across hosts, one fixed-size message per rank, gathered along this rank's line (the
   ranks at the same place on every host): a status, the host's MAX, and for a small
   allreduce the host's partial result. The size is fixed so that two different calls
   still exchange messages of one size and see each other's status.

The line is the one dimension across hosts when there is one; on a grid of the host's
ranks, then several dimensions across hosts (IBM DDL's GPUs x hosts x racks), it is a group
made for the round of the ranks at this place on every host (``grid.host_line``). On any
other grid (two dimensions inside a host, or none that is the whole host) the round has no
host step: each rank's message goes to every rank over the engine's group of all its
members (``multihost.round_covers`` None; ``DimsEngine`` passes that group as the line),
so each rank is its own "host".

Every rank of a line reads the same rows, and every line sees the same rows (the ranks of a
host share one status and one MAX), so every rank of the job decides the same: when every
host folded the same call and the MAX calls for nothing (``Fold.stop``), a small allreduce
reduces the gathered partial results in host order (bitwise the same everywhere) and is
done: one shared-memory step and one message across hosts for identity and data together.
Otherwise no rank's output was touched and every folded rank raises ``Unfolded`` with the
job-wide MAX, which negotiate handles as the result of a separate exchange. A rank that
exchanges its identity alone (``alone``: a joined rank, a call that failed here) meets the
folded ones in the same round. A host whose ranks ran different kinds of collective
(``DDLMismatchError`` inside it) says so in its status, so every host raises.

A core call (``ddl.allreduce``..., the torch ``ddl`` backend's) takes the same round with a
key instead of a Horovod descriptor (its collective, op, dtype, count, shape:
``DimsEngine._core``), so that two different calls on two hosts raise on every rank instead
of pairing; a small allreduce's data rides along as well.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..errors import DDLMismatchError
from ..ops import ReduceOp, reduce_into
from ..tensors import Pieces, copy_flat
from .shm_meta import MAX_IDENT, Fold, Unfolded

FOLD_BYTES = 8192  # an allreduce up to this size rides on the round
_HEAD = 2 + MAX_IDENT + 1  # status, length, the descriptor; even, so rows stay 16-aligned
_ROW = ROW_BYTES = _HEAD * 8 + FOLD_BYTES  # what each rank sends (cost.identity_round_time)
# statuses: the host reduced its data (DATA) or only settled its identities (IDENT), both
# folded; the host's identities call for the error path (UNFOLDED); this rank exchanged its
# identity alone (ALONE); the host's ranks ran different collectives (MISMATCH); the host's
# ranks refused the call before its data moved (REFUSING, ``refuse``)
DATA, IDENT, UNFOLDED, ALONE, MISMATCH, REFUSING = 1, 2, 3, 4, 5, 6
REFUSED_KEY = 1 << 41  # a refused call's key: no identity or core key (1 << 40) is equal


class IdentityRound:
    """The round of one multi-dimensional engine: ``local`` the shared-memory engine of this
    host's ranks (None with one rank per host), ``line`` the group of this rank and its
    counterparts on the other hosts (``allgather_bytes``), ``world`` the job's size."""

    def __init__(self, local, line, world: int, rank: int):
        self.local = local
        self.line = line
        self.world = world
        self.rank = rank
        if local is not None:
            local.keep_identity = True
        self._row = np.zeros(_ROW, np.uint8)
        self._head = self._row[: _HEAD * 8].view(np.int64)
        self._rows = np.zeros((line.size, _ROW), np.uint8)
        self._heads = self._rows[:, : _HEAD * 8].view(np.int64)
        self._work: dict[tuple, np.ndarray] = {}

    # ------------------------------------------------------------------ the calls
    def allreduce(self, fold: Fold, src: np.ndarray | Pieces, dst: np.ndarray | Pieces,
                  dt: DType, op: ReduceOp) -> None:
        """``fold``'s call is an allreduce of at most FOLD_BYTES: identity and data in one
        round; raises ``Unfolded`` (nothing written to ``dst``) unless every rank's moved."""
        inner = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
        work = self._scratch(dt, src.size)
        copy_flat(src, work)
        failure = None
        if self.local is None:
            status, host = DATA, np.asarray(fold.words)
        else:
            self.local.fold_identity(fold)
            try:
                self.local.allreduce(work, work, dt, inner, (work.size,))
                status, host = DATA, self.local.last_identity
            except Unfolded as why:
                status, host = UNFOLDED, why.result
            except DDLMismatchError as exc:
                status, host, failure = _failed(exc), np.asarray(fold.words), exc
            finally:
                self.local.cancel_fold()
        self._row[_HEAD * 8 : _HEAD * 8 + work.nbytes] = work.view(np.uint8)
        result = self._exchange(status, host, failure)
        if status == DATA and self._all(DATA) and not fold.stop(result):
            st = dt.storage
            terms = [self._rows[h, _HEAD * 8 : _HEAD * 8 + work.nbytes].view(st)
                     for h in range(self.line.size)]
            reduce_into(work, terms, inner, dt)
            if op is ReduceOp.AVERAGE:
                reduce_into(work, [work], ReduceOp.AVERAGE, dt, self.world)
            if isinstance(dst, Pieces):
                dst.copy_from(0, dst.size, work)
            else:
                np.copyto(dst, work)
            return
        raise Unfolded(result)

    def settle(self, fold: Fold) -> None:
        """Any other call: its identity alone in the round, before its data moves; returns
        when its data may move, else raises ``Unfolded``."""
        status, host, failure = self._local_alone(np.array(fold.words), IDENT)
        result = self._exchange(status, host, failure)
        if status == IDENT and self._all(IDENT) and not fold.stop(result):
            return
        raise Unfolded(result)

    def alone(self, desc: np.ndarray) -> np.ndarray:
        """The job-wide MAX of every rank's descriptor, ``desc`` being this rank's alone."""
        status, host, failure = self._local_alone(desc.copy(), ALONE)
        desc[:] = self._exchange(status, host, failure)
        return desc

    def refuse(self) -> None:
        """This rank refused the call its peers make now (``api._planned``): the host's step
        of refusal, then the line's round with a key no call has. Raises
        ``DDLMismatchError`` on every rank unless every rank refused."""
        failure = None
        if self.local is not None:
            try:
                self.local.refuse()
            except DDLMismatchError as exc:
                failure = exc
        self._exchange(REFUSING, np.array([REFUSED_KEY], np.int64), failure)

    # ------------------------------------------------------------------ the parts
    def _local_alone(self, desc: np.ndarray, status: int):
        if self.local is None:
            return status, desc, None
        try:
            return status, self.local.exchange_identity(desc), None
        except DDLMismatchError as exc:
            return _failed(exc), desc, exc

    def _exchange(self, status: int, host: np.ndarray, failure: BaseException | None):
        """Send this host's status and MAX along the line; the job-wide MAX, the same on
        every rank (a mismatch raises on every rank instead)."""
        head, n = self._head, host.size
        head[0], head[1] = status, n
        head[2 : 2 + n] = host
        self.line.allgather_bytes(self._row, self._rows.reshape(-1))
        heads = self._heads
        if failure is not None:
            raise failure
        refusing = heads[:, 0] == REFUSING
        if refusing.any() and not refusing.all():
            raise DDLMismatchError(
                f"rank {self.rank}: {self._who()} {np.flatnonzero(refusing).tolist()} refused "
                "this call before its data moved (their own error says why): every rank "
                "raises, and the job stays in step")
        bad = (heads[:, 0] == MISMATCH) | (heads[:, 1] != n)
        if bad.any():
            raise DDLMismatchError(
                f"rank {self.rank}: {self._who()} {np.flatnonzero(bad).tolist()} ran a "
                "different collective (their own error names it): every rank must issue the "
                "same collectives in the same order")
        return np.maximum.reduce(heads[:, 2 : 2 + n], axis=0)

    def _who(self) -> str:
        """What a row stands for in messages: on a line of every rank (no host step), a
        rank."""
        if self.local is None and self.line.size == self.world:
            return "rank(s)"
        return "the ranks of host position(s)"

    def _all(self, status: int) -> bool:
        return bool((self._heads[:, 0] == status).all())

    def _scratch(self, dt: DType, count: int) -> np.ndarray:
        key = (dt.storage, count)
        work = self._work.get(key)
        if work is None:
            if len(self._work) > 64:
                self._work.clear()
            work = self._work[key] = np.empty(count, dt.storage)
        return work


def _failed(exc: DDLMismatchError) -> int:
    """The status of a host whose ranks' step raised ``exc``: a refusal among them, or
    different collectives."""
    return REFUSING if getattr(exc, "refused", False) else MISMATCH
