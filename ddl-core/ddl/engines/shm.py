"""The shared-memory engine: collectives among the ranks of one host.

The ranks meet in a per-job control segment (shm_attach.py: its layout, making and
attaching, the cross-memory agreement): one control block per local rank and a staging
area holding, per parity, one slot per rank. This module holds the collective steps.

Protocol. Every collective is a sequence of *steps*. In step ``s`` a rank writes only into
the parity ``s % 2`` part of its own slot (and its metadata record), then publishes
``seq = s``, then waits until every peer's counter reaches ``s``, then reads. Because a rank
enters step ``s + 2`` only after every peer published ``s + 1`` (which they do after they
finished reading step ``s``), one monotonically increasing counter per rank replaces all
"done reading" flags: this is double buffering by parity. The first step of a collective
carries the metadata records, checked before anything depends on them.

Call identities. A Horovod-level call's descriptor (ddl.hvd.negotiate) can ride on that
first step (``fold_identity``) instead of costing a collective of its own: every rank
reads every descriptor after the step, computes the same MAX, and either all run the data
phase in that step or all return the MAX to negotiate (``Unfolded``) without reading any
peer's data. ``exchange_identity`` is the step of a descriptor alone (a joined rank, a
call that failed here); the ranks that folded theirs meet it in their first step.

Algorithms. Small messages take one step: every rank copies its input into its slot and
reduces all inputs itself, in rank order, so every rank computes bitwise the same result.
Larger ones reduce-scatter then allgather in chunks that fit the staging area: rank ``r``
reduces part ``r`` of each chunk and publishes the result, while the next chunk's inputs are
already staged (one synchronisation per chunk): shm_chunks.py holds that walk and the
three places a peer's data is read from (its heap, where buffers from ``ddl.malloc`` are
read in place; its private memory, by cross-memory copies; its staging slot).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from .. import identity
from ..dtypes import DType
from ..errors import DDLConfigError, DDLError, DDLMismatchError
from ..grid import even_split
from ..ops import ReduceOp, reduce_into
from ..tensors import Pieces
from . import cma as cma_mod
from . import segments, shm_attach
from .heap import Heap, PeerHeaps
from .hugepages import HotBuffers, PageSizes
from .shm_attach import (
    ControlSegment,
    W,
    agree_cross_memory,
    one_step_bytes,
    remote_location,
    staging_slot,
)
from .shm_chunks import ChunkPlan, read, stage_inputs
from .shm_meta import (
    ALLGATHER,
    ALLREDUCE,
    ALONE,
    BARRIER,
    BROADCAST,
    COLL_NAMES,
    FOLDED,
    IDENTITY,
    M_COUNT,
    M_IN,
    M_OUT,
    REDUCE_SCATTER,
    REFUSED,
    SPAN_BCAST,
    SPAN_GATHER,
    SPAN_KEY,
    SPAN_REDUCE,
    Fold,
    Identities,
    MetaKey,
    Records,
    Unfolded,
    check_identity,
    coll_key,
)
from .shm_sync import (
    S_ABORTED,
    Stepper,
    default_policy,
    weakly_ordered,
)

_log = logging.getLogger("ddl")
# The one-step allreduce is the latency path: its MetaKey is made without the generated
# __new__ (tuple.__new__ is the same tuple, a third of the cost) and its key word looked up.
_new = tuple.__new__
_ALLREDUCE_KEYS = [coll_key(ALLREDUCE, op) for op in range(16)]
# the control segment's header, under the names tests that write one by hand know
_MAGIC, _LAYOUT, _HDR, _BLOCK = (shm_attach.MAGIC, shm_attach.LAYOUT, shm_attach.HDR,
                                 shm_attach.BLOCK)


def _same_memory(a, b) -> bool:
    """Whether two buffers of an allreduce are one (in place), also as two views."""
    return a is b or (a.__class__ is b.__class__ is np.ndarray
                      and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def _nothing_waiting() -> bool:
    return False


class ShmEngine:
    """Collectives among ``local_size`` processes on one host, through /dev/shm."""

    name = "shm"

    def __init__(
        self,
        *,
        job_id: str,
        host_index: int,
        local_rank: int,
        local_size: int,
        global_rank: int,
        timeout: float = 30.0,
        init_timeout: float = 30.0,
        slot_bytes: int = 4 << 20,
        max_bytes: int = 32 << 20,
        small_bytes: int | str = "auto",
        wait_policy: str = "auto",
        heap_bytes: int = 256 << 20,
        block_bytes: int = 256 << 10,
        fences: bool | None = None,
        scope: str = "",
        token: int | None = None,
        dump_iter: int = 0,
        cma: bool | str = False,
        callers_waiting: Callable[[], bool] | None = None,
    ):
        """``dump_iter``: every this many allreduces, rank 0 logs their time (``-dump_iter``
        of a job on one host; in a multi-host job the multi-dimensional engine does).
        ``cma``: let peers read and write this rank's private buffers (engines/cma.py) when
        every local rank can: True every one from 8 MiB, ``"auto"`` those on huge pages
        (engines/hugepages.py); False stages them. ``callers_waiting``: whether some thread
        is blocked waiting for queued collectives (ddl.runtime), so a collective run off
        the main thread may spin on the core it leaves idle; None: nothing ever waits."""
        if not 0 <= local_rank < local_size:
            raise DDLConfigError(f"local rank {local_rank} is outside 0..{local_size - 1}")
        self.job_id = segments.validate_job_id(job_id)
        self.host_index = host_index
        self.rank = local_rank
        self.size = n = local_size
        self.global_rank = global_rank
        self.timeout = float(timeout)
        # marks the segment as this job's: a rank never joins a segment of another job
        secret = identity.job_secret()
        token = token if token is not None else identity.segment_token(job_id, secret)
        slot = staging_slot(slot_bytes, max_bytes, n)
        self.slot_bytes = slot
        self.small_bytes = one_step_bytes(small_bytes, n, slot)
        self.block_bytes = block_bytes
        self.wait_policy = default_policy(n) if wait_policy == "auto" else wait_policy
        self._failed: BaseException | None = None
        self._dump_iter = dump_iter
        self._calls = 0
        self._wall = 0.0
        # scope tells apart the engines of one rank (one per grid line in a multi-host job)
        self._seg = seg = ControlSegment(
            segments.segment_name(job_id, host_index, f"{scope}ctl", secret), job_id=job_id,
            token=token, rank=local_rank, size=n, global_rank=global_rank, slot=slot,
            small=self.small_bytes, init_timeout=init_timeout)
        # read on every step: the engine's own references
        self._slots, self._regions, self._peers = seg.slots, seg.regions, seg.peers
        self._view_cache: dict[tuple, list] = {}
        self.heap = Heap(job_id, host_index, local_rank, heap_bytes, scope, secret=secret,
                         token=token)
        self._peer_heaps = PeerHeaps(job_id, host_index, scope, secret=secret, token=token)
        xmem = cma_mod.load() if cma and n > 1 else None
        # read by every peer at start (the cross-memory probe)
        probe = (np.array([cma_mod.probe_value(token, local_rank)], np.int64)
                 if xmem is not None else None)
        seg.attach(init_timeout, probe)
        self._step = Stepper(seg.mm, seg.q, seg.blocks, local_rank,
                             granks=seg.peer_grank, pids=seg.peer_pid,
                             timeout=self.timeout, policy=self.wait_policy,
                             fences=weakly_ordered() if fences is None else fences,
                             callers_waiting=callers_waiting or _nothing_waiting)
        self._records = Records(seg.q, seg.qb, seg.blocks, local_rank, seg.peer_grank)
        self._idents = Identities(seg.q, seg.qb, seg.words, seg.blocks, local_rank, W)
        self._xmem = agree_cross_memory(seg, self._step, xmem)
        # which of our private buffers the peers reach in place (None: every one)
        self._reach: HotBuffers | None = (
            HotBuffers(PageSizes()) if self._xmem is not None and cma == "auto" else None)
        self._scratch: dict[tuple, list[np.ndarray]] = {}  # blocks read from peers (cma)
        # the fold the next collective's first step carries (fold_identity); None once one
        # took it: its owner reads this to know whether one did
        self.armed: Fold | None = None
        # set by the multi-host engine, which sends the host's identities on: each step that
        # carries a folded identity and moves its data leaves their MAX in last_identity
        self.keep_identity = False
        self.last_identity: np.ndarray | None = None

    @property
    def cross_memory(self) -> bool:
        """Whether peers read and write this rank's private buffers in place."""
        return self._xmem is not None

    @property
    def hot_buffers(self) -> HotBuffers | None:
        """Which private buffers peers reach in place (``cma="auto"``; None: every one
        when ``cross_memory``, else none)."""
        return self._reach

    # ------------------------------------------------------------- stepping
    def _me(self) -> str:
        return f"rank {self.global_rank}"

    def _first_step(self, s: int, key: MetaKey, spans: tuple, what: tuple) -> None:
        """Step ``s``, the first of a collective: this rank's data for it is written; add
        its record (and the call identity armed by ``fold_identity``), synchronise, settle
        the identities, and check that every rank runs the same collective."""
        p = s & 1
        fold = self.armed
        if fold is None:
            self._records.write(p, key)
        else:
            self.armed = None
            self._records.write(p, key, FOLDED)
            record, mine, peers = self._idents.span(p, fold)
            record[:] = fold.image  # one copy of the whole record
        self._step.arrive(s)
        self._step.wait_all(s, what)
        if fold is not None:
            # Every rank folded the same call (the head words hold the flags): the data
            # moves, nothing to compute. A peer that runs a core
            # call here has a stale identity record, maybe equal to ours, but its metadata
            # key differs: the records' check below raises.
            settle = True
            if fold.same:
                for theirs in peers:
                    if theirs != mine:
                        break
                else:
                    settle = False
            if settle:
                self._settle_identities(p, fold, what)
            if self.keep_identity:
                self.last_identity = self._idents.result(p)
        # (a peer whose step carries an identity while ours does not differs in its key)
        self._records.check(p, spans, what)

    def _settle_identities(self, p: int, fold: Fold | None, what: tuple) -> np.ndarray | None:
        """After a step that carried our identity, unless every rank folded the same call:
        the MAX of every rank's descriptor, or ``Unfolded`` (with it) where this rank folded
        its identity into a data step whose data must not move. Every rank decides from the
        same records."""
        flags = self._idents.flags(p)
        if not all(flags) or not self._idents.lengths_agree(p):
            raise self._records.error(p, what, mixed=True)
        result = self._idents.result(p)
        if fold is not None and (not all(f == FOLDED for f in flags) or fold.stop(result)):
            raise Unfolded(result)
        return result

    def fold_identity(self, fold: Fold) -> None:
        """Carry ``fold``'s descriptor in the first step of the next collective on this engine. That
        collective raises ``Unfolded`` where its data must not move (see the module
        docstring and ``Fold``, which checked the descriptor when it was made)."""
        self.armed = fold

    def cancel_fold(self) -> Fold | None:
        """Disarm a fold no collective took (the call moved no data here); returns it."""
        fold, self.armed = self.armed, None
        return fold

    def exchange_identity(self, desc: np.ndarray) -> np.ndarray:
        """The MAX of every rank's ``desc``, in place, in one step of its own."""
        return self._run(self._exchange_identity, desc)

    def _exchange_identity(self, desc: np.ndarray) -> np.ndarray:
        s = self._step.seq + 1
        p = s & 1
        what = ("identity exchange", "int64", desc.size, None)
        check_identity(desc)
        self._records.write(p, MetaKey(coll_key(IDENTITY), 0, desc.size, ()), ALONE)
        self._idents.write(p, desc, ALONE)
        self._step.arrive(s)
        self._step.wait_all(s, what)
        desc[:] = self._settle_identities(p, None, what)
        return desc

    def _next_step(self, s: int, what: tuple) -> None:
        self._step.arrive(s)
        self._step.wait_all(s, what)

    def _run(self, fn: Callable, *args):
        if self._failed is not None:
            raise DDLError(
                f"{self._me()}: the shared-memory engine failed earlier ({self._failed}); "
                "the job cannot continue"
            )
        try:
            return fn(*args)
        except (DDLMismatchError, Unfolded):
            raise  # every rank saw the same records at the same step: still in sync
        except BaseException as exc:
            self._failed = exc
            try:
                self._seg.publish_state(S_ABORTED)
            except (ValueError, TypeError):
                pass
            raise

    # ---------------------------------------------------------- collectives
    def barrier(self) -> None:
        self._run(self._barrier)

    def _barrier(self) -> None:
        s = self._step.seq + 1
        self._first_step(s, MetaKey(coll_key(BARRIER), 0, 0, ()), SPAN_KEY,
                         ("barrier", "-", 0, None))

    def refuse(self) -> None:
        """Take the place of a call this rank refused before its data moved (``api._planned``):
        a step whose record no collective has, so that peers running the call raise
        ``DDLMismatchError`` and peers that refused it too pass."""
        self._run(self._refuse)

    def _refuse(self) -> None:
        s = self._step.seq + 1
        self._first_step(s, MetaKey(coll_key(REFUSED), 0, 0, ()), SPAN_KEY,
                         ("a refused call", "-", 0, None))

    def allreduce(self, src: np.ndarray | Pieces, dst: np.ndarray | Pieces, dt: DType,
                  op: ReduceOp, shape: tuple[int, ...]) -> None:
        """dst = op over ranks of src. ``dst`` is ``src`` itself or does not overlap it.
        ``src`` may be the ``Pieces`` of a fusion buffer that is never filled (reduced into
        ``dst`` or in place): each piece is staged from where it lives, which saves the
        packing pass over the data."""
        t0 = time.perf_counter() if self._dump_iter else 0.0
        if src.nbytes <= self.small_bytes:
            self._run(self._allreduce_small, src, dst, dt, op, shape)
        else:
            counts = even_split(src.size, self.size)
            self._run(self._reduce_scatter_steps, ALLREDUCE, src, dst, dt, op, shape, counts)
        if self._dump_iter:
            self._dump(src.nbytes, time.perf_counter() - t0)

    def _dump(self, nbytes: int, wall: float) -> None:
        """Every ``dump_iter`` allreduces rank 0 logs the wall time per call, as the
        multi-dimensional engine's ``-dump_iter`` line does per dimension."""
        self._wall += wall
        self._calls += 1
        if self._calls % self._dump_iter == 0:
            if self.global_rank == 0:
                alg = "one-step" if nbytes <= self.small_bytes else "reduce-scatter+allgather"
                _log.info("[ddl] allreduce #%d (%d B): dim0 x%d shm/%s; wall %.2f ms per call",
                          self._calls, nbytes, self.size, alg,
                          1e3 * self._wall / self._dump_iter)
            self._wall = 0.0

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, dt: DType, op: ReduceOp,
                       shape: tuple[int, ...], counts: list[int]) -> None:
        """dst (counts[rank] elements) = op over ranks of src[offset_r : offset_r + count_r]."""
        self._run(self._reduce_scatter_steps, REDUCE_SCATTER, src, dst, dt, op, shape, counts)

    def _small_views(self, p: int, nbytes: int, st: np.dtype) -> list[np.ndarray]:
        """Every rank's slot of parity ``p`` as ``nbytes`` of ``st`` (cached: hot path)."""
        key = (p, nbytes, st)
        v = self._view_cache.get(key)
        if v is None:
            slots = self._slots[p]
            v = [slots[i][:nbytes].view(st) for i in range(self.size)]
            if len(self._view_cache) > 256:
                self._view_cache.clear()
            self._view_cache[key] = v
        return v

    def _allreduce_small(self, src, dst, dt: DType, op: ReduceOp, shape) -> None:
        s = self._step.seq + 1
        terms = self._small_views(s & 1, src.nbytes, dt.storage)
        if src.__class__ is np.ndarray:
            terms[self.rank][...] = src  # a third of np.copyto's cost at 1 KiB
        else:
            read(src, 0, src.size, terms[self.rank])
        self._first_step(s, _new(MetaKey, (_ALLREDUCE_KEYS[op], dt.code, src.size, shape, 0, 0, 0)),
                         SPAN_REDUCE, ("allreduce", dt.name, src.size, op))
        if isinstance(dst, Pieces):
            for lo, hi, out in dst.cuts(0, dst.size):
                reduce_into(out, [t[lo:hi] for t in terms], op, dt, self.size)
        else:
            reduce_into(dst, terms, op, dt, self.size)

    def _staged_share(self, itemsize: int) -> int:
        """Elements of each part per chunk when a slot stages every part and our result."""
        share = self.slot_bytes // itemsize // (self.size + 1)
        return share - share % 64 if share >= 64 else share

    def _reduce_scatter_steps(self, coll: int, src, dst, dt: DType, op: ReduceOp, shape,
                              counts: list[int]) -> None:
        """Reduce-scatter by chunks; for an allreduce (``coll``) the reduced parts are
        passed on as they are made, which is the allgather."""
        gather = coll == ALLREDUCE
        what = (COLL_NAMES[coll], dt.name, src.size, op)
        share = self._staged_share(dt.itemsize)
        starts = [0] * self.size
        for j in range(1, self.size):
            starts[j] = starts[j - 1] + counts[j - 1]
        # The first step stages chunk 0 (if our input is private) and carries the records:
        # shapes are checked and heap locations exchanged before anything depends on them.
        s = self._step.seq + 1
        p = s & 1
        in_loc = 0 if isinstance(src, Pieces) else self.heap.locate(src)
        out_loc = self.heap.locate(dst) if gather and not isinstance(dst, Pieces) else 0
        if src.nbytes >= cma_mod.MIN_BYTES:  # (the same size on every rank)
            if not in_loc:
                in_loc = remote_location(self._xmem, src, self._reach)
            if gather and not out_loc:
                # in place: one verdict (the policy counts a buffer's calls)
                out_loc = in_loc if _same_memory(src, dst) else remote_location(
                    self._xmem, dst, self._reach)
        if not in_loc:
            self._stage_inputs(src, p, 0, share, counts, starts, dt)
        self._first_step(s, MetaKey(coll_key(coll, op), dt.code, src.size, shape, 0, in_loc,
                                    out_loc), SPAN_REDUCE, what)
        plan = self._chunk_plan(p, share, counts, starts, src.size, dt, gather)
        own_in_private = in_loc == 0
        own_out_private = gather and out_loc == 0
        # One step more after the last chunk: an allreduce collects the last reduced parts;
        # a reduce-scatter where some rank's input is read in place (from its heap or by
        # cross-memory copies) waits until its readers are done. Every rank decides from
        # the same records.
        trailing = 1 if gather or plan.read_in_place else 0
        for chunk in range(plan.chunks + trailing):
            if chunk:  # the first step above was chunk 0's synchronisation
                s += 1
                p = s & 1
                if chunk < plan.chunks and own_in_private:
                    self._stage_inputs(src, p, chunk, plan.share, counts, starts, dt)
                self._next_step(s, what)
            if own_out_private and chunk:
                plan.collect(dst, self._slots[p], chunk - 1, dt)
            if chunk < plan.chunks:
                plan.reduce(src, dst, self._slots[p], self._slots[p ^ 1][self.rank], chunk, dt,
                            op, gather)

    def _stage_inputs(self, src, p: int, chunk: int, share: int, counts: list[int],
                      starts: list[int], dt: DType) -> None:
        """Copy chunk ``chunk`` of every part but ours into our slot of parity ``p``."""
        stage_inputs(src, self._slots[p][self.rank], self.rank, self._peers, chunk, share,
                     counts, starts, dt)

    def _chunk_plan(self, p: int, share: int, counts: list[int], starts: list[int],
                    numel: int, dt: DType, gather: bool) -> ChunkPlan:
        """The walk, once every rank's heap locations are known (first step's records)."""
        records = self._records
        locs_in = [records.field(i, p, M_IN) for i in range(self.size)]
        locs_out = [records.field(i, p, M_OUT) if gather else 0 for i in range(self.size)]
        in_views: list[np.ndarray | None] = [None] * self.size
        out_views: list[np.ndarray | None] = [None] * self.size
        in_remote: list[tuple[int, int] | None] = [None] * self.size
        out_remote: list[tuple[int, int] | None] = [None] * self.size
        nbytes, st = numel * dt.itemsize, dt.storage
        for i in self._peers:
            # a location word > 0 is in the peer's heap, < 0 minus a private address
            loc = locs_in[i]
            if loc > 0:
                in_views[i] = self._peer_heaps.view(i, loc, nbytes, st)
            elif loc < 0:
                in_remote[i] = (self._seg.peer_pid[i], -loc)
            loc = locs_out[i]
            if loc > 0:
                out_views[i] = self._peer_heaps.view(i, loc, nbytes, st)
            elif loc < 0:
                out_remote[i] = (self._seg.peer_pid[i], -loc)
        if all(locs_in) and (not gather or all(locs_out)):
            share = max(1, max(counts))  # nothing is staged: one chunk, reduced block by block
        largest = max(counts)
        block = max(1, self.block_bytes // dt.itemsize)
        scratch = None
        if any(in_remote):
            # each cross-memory read pins the peer's pages: larger blocks spread that cost
            block = max(block, cma_mod.BLOCK_BYTES // dt.itemsize)
            key = (st, block)
            scratch = self._scratch.get(key)
            if scratch is None:
                scratch = self._scratch[key] = [np.empty(block, st) for _ in range(self.size)]
        seg = self._seg
        return ChunkPlan(share=share, chunks=-(-largest // share) if largest else 0,
                         counts=counts, starts=starts, in_views=in_views, out_views=out_views,
                         publish=gather and not all(locs_out), block=block,
                         in_remote=in_remote, out_remote=out_remote, scratch=scratch,
                         read_in_place=any(locs_in), rank=self.rank, size=self.size,
                         peers=self._peers, xmem=self._xmem, me=self._me(),
                         granks=seg.peer_grank, pids=seg.peer_pid)

    def allgather(self, src: np.ndarray, dt: DType, row_shape: tuple[int, ...],
                  alloc: Callable[[list[int]], np.ndarray]) -> np.ndarray:
        """Concatenate every rank's ``src`` (rows of ``row_shape``; counts may differ).
        ``alloc(counts)`` returns the flat output once the element counts are known."""
        return self._run(self._allgather, src, dt, row_shape, alloc)

    def _allgather(self, src, dt: DType, row_shape, alloc) -> np.ndarray:
        r = self.rank
        st, isz = dt.storage, dt.itemsize
        per_step = self.slot_bytes // isz  # elements of each rank moved per step
        s = self._step.seq + 1
        p = s & 1
        numel = src.size
        what = ("allgather", dt.name, numel, None)
        first = min(numel, per_step)
        np.copyto(self._slots[p][r][: first * isz].view(st), src[:first])
        self._first_step(s, MetaKey(coll_key(ALLGATHER), dt.code, numel, row_shape),
                         SPAN_GATHER, what)
        counts = [self._records.field(i, p, M_COUNT) for i in range(self.size)]
        dst = alloc(counts)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        for chunk in range(max(1, -(-max(counts) // per_step))):
            at = chunk * per_step
            if chunk:
                s += 1
                p = s & 1
                length = min(numel - at, per_step)
                if length > 0:
                    np.copyto(self._slots[p][r][: length * isz].view(st), src[at : at + length])
                self._next_step(s, what)
            for i in range(self.size):
                length = min(counts[i] - at, per_step)
                if length <= 0:
                    continue
                o = starts[i] + at
                if i == r:
                    np.copyto(dst[o : o + length], src[at : at + length])
                else:
                    np.copyto(dst[o : o + length], self._slots[p][i][: length * isz].view(st))
        return dst

    def broadcast(self, buf: np.ndarray, dt: DType, root: int, shape: tuple[int, ...]) -> None:
        """buf on every rank = buf on local rank ``root``."""
        self._run(self._broadcast, buf, dt, root, shape)

    def _broadcast(self, buf, dt: DType, root: int, shape) -> None:
        st, isz = dt.storage, dt.itemsize
        per_step = len(self._regions[0]) // isz  # the root may use the whole parity region
        numel = buf.size
        what = ("broadcast", dt.name, numel, None)
        s = self._step.seq
        for chunk in range(max(1, -(-numel // per_step))):
            s += 1
            p = s & 1
            at = chunk * per_step
            length = min(numel - at, per_step)
            region = self._regions[p]
            if self.rank == root and length > 0:
                np.copyto(region[: length * isz].view(st), buf[at : at + length])
            if chunk == 0:
                self._first_step(s, MetaKey(coll_key(BROADCAST), dt.code, numel, shape, root),
                                 SPAN_BCAST, what)
            else:
                self._next_step(s, what)
            if self.rank != root and length > 0:
                np.copyto(buf[at : at + length], region[: length * isz].view(st))

    # -------------------------------------------------------------- teardown
    def close(self) -> None:
        if self._seg.mm is None:
            return
        try:
            if self._failed is None:
                self._seg.publish_leaving()
        finally:
            self.heap.close()
            self._peer_heaps.close()
            self._step.close()
            self._idents.close()
            self._slots = self._regions = None
            self._view_cache.clear()
            if self._reach is not None:
                self._reach.close()
            self._seg.close()
