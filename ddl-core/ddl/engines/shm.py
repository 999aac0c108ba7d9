"""The shared-memory engine: collectives among the ranks of one host.

Layout of the per-job control segment ``ddl-<job>-h<host>-ctl`` (keyed, ``-k<key>``, when the
job has a secret: segments.py)::

    header (4 KiB) | one 2 KiB control block per local rank | staging area

A control block holds the rank's *step counter*, pid, state, global rank (shm_sync) and,
per parity, a metadata record and a call-identity record (shm_meta). The staging area
holds, per parity, one slot per rank.

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
already staged (one synchronisation per chunk). Buffers from ``ddl.malloc`` are read and
written in place by the peers, which removes both copies.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .. import failures, identity
from ..config import SLOT_MIN, show_size
from ..dtypes import DType
from ..errors import (
    DDLConfigError,
    DDLError,
    DDLMismatchError,
    DDLPeerError,
    DDLShmError,
    DDLTimeoutError,
)
from ..grid import even_split
from ..ops import ReduceOp, reduce_into
from ..tensors import Pieces
from . import cma as cma_mod
from . import segments
from .heap import Heap, PeerHeaps
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
    S_ATTACHED,
    S_CLOSED,
    S_EXITING,
    S_NONE,
    W_CMA,
    W_CMA_OK,
    W_GRANK,
    W_PID,
    W_SEQ,
    W_STATE,
    Stepper,
    default_policy,
    pid_alive,
    weakly_ordered,
    write_reason,
)

_log = logging.getLogger("ddl")
# The one-step allreduce is the latency path: its MetaKey is made without the generated
# __new__ (tuple.__new__ is the same tuple, a third of the cost) and its key word looked up.
_new = tuple.__new__
_ALLREDUCE_KEYS = [coll_key(ALLREDUCE, op) for op in range(16)]
_MAGIC = 0x4C44445F4D485344  # "DSHM_DDL"
_LAYOUT = 4
_HDR = 4096
_BLOCK = 2048
_W = _BLOCK // 8  # words per control block
# header words
H_MAGIC, H_LAYOUT, H_SIZE, H_SLOT, H_PID, H_READY = range(6)
H_TOKEN = segments.TOKEN_OFFSET // 8  # 6: where every segment carries the job's token


def staging_slot(slot_bytes: int, max_bytes: int, ranks: int) -> int:
    """Bytes of staging per rank and parity: DDL_SHM_SLOT_BYTES, capped so that the
    ``2 x ranks`` slots fit in DDL_SHM_MAX_BYTES, in whole pages. DDLConfigError naming the
    variable at fault when that leaves less than 64 KiB (ddlrun asks this before it starts
    the ranks)."""
    slot = min(slot_bytes, max_bytes // (2 * ranks)) // 4096 * 4096
    if slot >= SLOT_MIN:
        return slot
    if slot_bytes < SLOT_MIN:
        raise DDLConfigError(
            f"DDL_SHM_SLOT_BYTES={show_size(slot_bytes)} is below the shared-memory engine's "
            f"minimum staging of {show_size(SLOT_MIN)} per rank and parity: set it to "
            f"{show_size(SLOT_MIN)} or more"
        )
    raise DDLConfigError(
        f"DDL_SHM_MAX_BYTES={show_size(max_bytes)} leaves {slot} bytes of staging per rank "
        f"and parity for {ranks} ranks on this host; it needs {show_size(SLOT_MIN)} each: "
        f"set DDL_SHM_MAX_BYTES={show_size(2 * ranks * SLOT_MIN)} or more"
    )


def _parts(src: np.ndarray | Pieces, lo: int, hi: int) -> list:
    """``(lo, hi, view)`` for elements ``[lo, hi)`` of ``src``, cut where its pieces end."""
    if isinstance(src, Pieces):
        return src.cuts(lo, hi)
    return [(lo, hi, src[lo:hi])]


def _read(src: np.ndarray | Pieces, lo: int, hi: int, out: np.ndarray) -> None:
    if isinstance(src, Pieces):
        src.copy_to(lo, hi, out)
    else:
        np.copyto(out, src[lo:hi])


def _write(dst: np.ndarray | Pieces, lo: int, hi: int, data: np.ndarray) -> None:
    if isinstance(dst, Pieces):
        dst.copy_from(lo, hi, data)
    else:
        np.copyto(dst[lo:hi], data)


class _Chunks(NamedTuple):
    """How a reduce-scatter (and the allgather after it) walks the data. Rank ``i`` owns
    the elements ``[starts[i], starts[i] + counts[i])``; chunk ``t`` covers elements
    ``[t * share, (t + 1) * share)`` of every rank's part. A staged slot holds, for one
    chunk, ``share`` elements of every part (the inputs its reducers read) and then
    ``share`` elements of its own reduced part (what the others collect)."""

    share: int
    chunks: int  # chunks of the largest part
    counts: list[int]
    starts: list[int]
    in_views: list  # peer i's input read in place from its heap, or None (staged)
    out_views: list  # peer i's output written in place in its heap, or None (it collects)
    publish: bool  # some rank collects our reduced part from our slot
    block: int  # elements reduced, then passed on, at a time: while they are in cache
    in_remote: list  # (pid, address) of peer i's private input, read by cross-memory copy
    out_remote: list  # (pid, address) of peer i's private output, written likewise
    scratch: list | None  # one block per peer: what was read from its private input
    read_in_place: bool  # some rank's input is read where it lives, not from its slot


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
        small_bytes: int = 64 << 10,
        wait_policy: str = "auto",
        heap_bytes: int = 256 << 20,
        block_bytes: int = 256 << 10,
        fences: bool | None = None,
        scope: str = "",
        token: int | None = None,
        dump_iter: int = 0,
        cma: bool = False,
    ):
        """``dump_iter``: every this many allreduces, rank 0 logs their time (``-dump_iter``
        of a job on one host; in a multi-host job the multi-dimensional engine does).
        ``cma``: let peers read and write this rank's private buffers (engines/cma.py) when
        every local rank can; False stages them."""
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
        self._token = token if token is not None else identity.segment_token(job_id, secret)
        slot = staging_slot(slot_bytes, max_bytes, n)
        self.slot_bytes = slot
        self.small_bytes = min(small_bytes, slot)
        self.block_bytes = block_bytes
        self.wait_policy = default_policy(n) if wait_policy == "auto" else wait_policy
        self._failed: BaseException | None = None
        self._dump_iter = dump_iter
        self._calls = 0
        self._wall = 0.0
        # scope tells apart the engines of one rank (one per grid line in a multi-host job)
        self._name = segments.segment_name(job_id, host_index, f"{scope}ctl", secret)
        self._ctl_bytes = _HDR + n * _BLOCK
        staging_off = -(-self._ctl_bytes // 4096) * 4096
        total = staging_off + 2 * n * slot
        self._mm = self._create_or_attach(total, init_timeout)
        self._qb = memoryview(self._mm)[: self._ctl_bytes]
        self._q = self._qb.cast("q")
        self._view_cache: dict[tuple, tuple] = {}
        self._fences = weakly_ordered() if fences is None else fences
        self._staging = np.frombuffer(self._mm, np.uint8, count=2 * n * slot, offset=staging_off)
        self._slots = [
            [self._staging[(p * n + i) * slot : (p * n + i + 1) * slot] for i in range(n)]
            for p in (0, 1)
        ]
        self._regions = [self._staging[p * n * slot : (p + 1) * n * slot] for p in (0, 1)]
        self._blk = [_HDR // 8 + i * _W for i in range(n)]
        self._my = self._blk[local_rank]
        self._peers = [i for i in range(n) if i != local_rank]
        self.heap = Heap(job_id, host_index, local_rank, heap_bytes, scope, secret=secret,
                         token=self._token)
        self._peer_heaps = PeerHeaps(job_id, host_index, scope, secret=secret,
                                     token=self._token)
        self._xmem = cma_mod.load() if cma and n > 1 else None
        # read by every peer at start (the cross-memory probe), published by _attach
        self._probe = np.array([cma_mod.probe_value(self._token, local_rank)], np.int64)
        try:
            self._attach(init_timeout)
        except BaseException:
            # a peer never came: do not leave the named segment behind (it is unlinked
            # only once every rank has attached)
            if self.rank == 0:
                segments.unlink(self._name)
            raise
        self._step = Stepper(self._mm, self._q, self._blk, local_rank,
                             granks=self._peer_grank, pids=self._peer_pid,
                             timeout=self.timeout, policy=self.wait_policy,
                             fences=self._fences)
        self._records = Records(self._q, self._qb, self._blk, local_rank, self._peer_grank)
        self._words = np.frombuffer(self._mm, np.int64, count=self._ctl_bytes // 8)
        self._idents = Identities(self._q, self._qb, self._words, self._blk, local_rank, _W)
        self._xmem = self._agree_cma()
        self._scratch: dict[tuple, list[np.ndarray]] = {}  # blocks read from peers (cma)
        # the fold the next collective's first step carries (fold_identity); None once one
        # took it: its owner reads this to know whether one did
        self.armed: Fold | None = None
        # set by the multi-host engine, which sends the host's identities on: each step that
        # carries a folded identity and moves its data leaves their MAX in last_identity
        self.keep_identity = False
        self.last_identity: np.ndarray | None = None

    # ------------------------------------------------------------------ setup
    def _create_or_attach(self, total: int, init_timeout: float) -> mmap.mmap:
        deadline = time.monotonic() + init_timeout
        if self.rank == 0:
            while True:
                try:
                    mm = segments.create(self._name, total, self._token)
                    break
                except FileExistsError:
                    self._remove_stale_or_fail()
            q = memoryview(mm)[:_HDR].cast("q")
            q[H_LAYOUT], q[H_SIZE], q[H_SLOT] = _LAYOUT, self.size, self.slot_bytes
            q[H_PID] = os.getpid()
            q[H_TOKEN] = self._token
            q[H_MAGIC] = _MAGIC
            q[H_READY] = 1
            q.release()
            return mm
        while True:
            mm = None
            try:
                mm = segments.open_existing(self._name)
                q = memoryview(mm)[:_HDR].cast("q")
                ok = q[H_READY] == 1 and q[H_MAGIC] == _MAGIC and pid_alive(q[H_PID])
                if ok and q[H_TOKEN] != self._token:
                    pid = q[H_PID]
                    q.release()
                    raise DDLShmError(
                        f"rank {self.global_rank}: {segments.SHM_DIR}/{self._name} belongs to "
                        f"another job (its creator, pid {pid}, has a different job secret): "
                        f"two jobs share job id {self.job_id!r}; give each its own DDL_JOB_ID "
                        "(ddlrun does)"
                    )
                if ok:
                    got = (q[H_LAYOUT], q[H_SIZE], q[H_SLOT])
                    if got != (_LAYOUT, self.size, self.slot_bytes):
                        q.release()
                        raise DDLConfigError(
                            f"rank {self.global_rank}: shared memory {self._name} was made for "
                            f"(layout, ranks, slot bytes) = {got}, this rank expects "
                            f"{(_LAYOUT, self.size, self.slot_bytes)}: do all ranks of the job "
                            "have the same LOCAL_WORLD_SIZE and DDL_SHM_* settings?"
                        )
                    q.release()
                    if len(mm) >= total:
                        return mm
                    # mapped between the token's write and the reservation of the rest
                    # (segments.create): the file has its full size now, map it again
                else:
                    q.release()
                mm.close()
            except (FileNotFoundError, ValueError):
                if mm is not None:
                    mm.close()
            if time.monotonic() > deadline:
                raise DDLTimeoutError(
                    f"rank {self.global_rank}: local rank 0 did not create {self._name} within "
                    f"{init_timeout:.0f}s (is local rank 0 running? DDL_INIT_TIMEOUT sets this)"
                )
            time.sleep(0.002)

    def _remove_stale_or_fail(self) -> None:
        try:
            mm = segments.open_existing(self._name)
        except FileNotFoundError:
            return  # half-made or just removed: try again
        q = memoryview(mm)[:_HDR].cast("q")
        pid = q[H_PID]
        q.release()
        mm.close()
        if pid and pid_alive(pid) and pid != os.getpid():
            raise DDLShmError(
                f"rank {self.global_rank}: {segments.SHM_DIR}/{self._name} belongs to a running "
                f"process (pid {pid}): two jobs share job id {self.job_id!r}; give each job its "
                "own DDL_JOB_ID (ddlrun does) or MASTER_PORT"
            )
        segments.unlink(self._name)  # left by a crashed job with the same id

    def _attach(self, init_timeout: float) -> None:
        q, b = self._q, self._my
        other = q[b + W_PID]
        if q[b + W_STATE] != S_NONE and other != os.getpid() and pid_alive(other):
            raise DDLShmError(
                f"rank {self.global_rank}: local rank {self.rank} of {self._name} is already "
                f"taken by pid {other}: two processes claim one rank (two jobs with one "
                "DDL_JOB_ID, or LOCAL_RANK given twice)"
            )
        q[b + W_PID] = os.getpid()
        q[b + W_GRANK] = self.global_rank
        q[b + W_SEQ] = 0
        q[b + W_CMA] = self._probe.__array_interface__["data"][0] if self._xmem else 0
        q[b + W_CMA_OK] = 0
        self._publish_state(S_ATTACHED)
        deadline = time.monotonic() + init_timeout
        for i in self._peers:
            while q[self._blk[i] + W_STATE] == S_NONE:
                if time.monotonic() > deadline:
                    raise DDLTimeoutError(
                        f"rank {self.global_rank}: local rank {i} did not attach to "
                        f"{self._name} within {init_timeout:g}s"
                    )
                time.sleep(0.001)
        self._peer_grank = {i: q[self._blk[i] + W_GRANK] for i in range(self.size)}
        self._peer_pid = {i: q[self._blk[i] + W_PID] for i in range(self.size)}
        if self.rank == 0:
            # Every rank has it mapped: drop the name so nothing can leak, even on SIGKILL.
            segments.unlink(self._name)

    def _agree_cma(self) -> cma_mod.CrossMemory | None:
        """One step at start: each rank reads every peer's probe word across address
        spaces; cross-memory copies are used only if every rank read every peer's (a job
        never mixes the paths: a reader whose peer staged nothing would wait forever)."""
        q, xmem = self._q, self._xmem
        # Every rank published its probe's address (0: it does not want cross-memory
        # copies) before attaching: when some rank does not, all know it without a step.
        if self.size == 1 or any(q[b + W_CMA] == 0 for b in self._blk):
            return None
        ok = xmem is not None and all(
            xmem.probe(self._peer_pid[i], q[self._blk[i] + W_CMA],
                       cma_mod.probe_value(self._token, i))
            for i in self._peers)
        q[self._my + W_CMA_OK] = 1 if ok else 2
        s = self._step.seq + 1
        self._step.arrive(s)
        self._step.wait_all(s, ("start-up (cross-memory probe)", "-", 0, None))
        if all(q[b + W_CMA_OK] == 1 for b in self._blk):
            return xmem
        if self.rank == 0:
            _log.debug("[ddl] %s: cross-memory attach unavailable; private buffers are staged",
                       self._name)
        return None

    @property
    def cross_memory(self) -> bool:
        """Whether peers read and write this rank's private buffers in place."""
        return self._xmem is not None

    def _remote(self, arr) -> int:
        """The record's location word for a private buffer the peers may reach by
        cross-memory copies: minus its address; 0 where it must be staged."""
        if self._xmem is None or isinstance(arr, Pieces) or not arr.flags.c_contiguous:
            return 0
        return -arr.__array_interface__["data"][0] if arr.nbytes else 0

    def _publish_state(self, state: int) -> None:
        self._q[self._my + W_STATE] = state

    def _publish_leaving(self) -> None:
        """What a peer still waiting for this rank is told: that the program called
        ``ddl.shutdown()`` (S_CLOSED), or that this process is exiting, and why (S_EXITING,
        with the uncaught exception when there is one: ddl.failures)."""
        why = failures.leaving()
        if why is None:
            self._publish_state(S_CLOSED)
            return
        write_reason(self._q, self._my, why)
        self._publish_state(S_EXITING)

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
                self._publish_state(S_ABORTED)
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
        if self._dump_iter:
            self._allreduce_dumped(src, dst, dt, op, shape)
            return
        if src.nbytes <= self.small_bytes:
            self._run(self._allreduce_small, src, dst, dt, op, shape)
        else:
            counts = even_split(src.size, self.size)
            self._run(self._reduce_scatter_steps, ALLREDUCE, src, dst, dt, op, shape, counts)

    def _allreduce_dumped(self, src, dst, dt: DType, op: ReduceOp, shape) -> None:
        """``allreduce`` timed: every ``dump_iter`` calls rank 0 logs the wall time per call,
        as the multi-dimensional engine's ``-dump_iter`` line does per dimension."""
        t0 = time.perf_counter()
        small = src.nbytes <= self.small_bytes
        if small:
            self._run(self._allreduce_small, src, dst, dt, op, shape)
        else:
            counts = even_split(src.size, self.size)
            self._run(self._reduce_scatter_steps, ALLREDUCE, src, dst, dt, op, shape, counts)
        self._wall += time.perf_counter() - t0
        self._calls += 1
        if self._calls % self._dump_iter == 0:
            if self.global_rank == 0:
                alg = "one-step" if small else "reduce-scatter+allgather"
                _log.info("[ddl] allreduce #%d (%d B): dim0 x%d shm/%s; wall %.2f ms per call",
                          self._calls, src.nbytes, self.size, alg,
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
        _read(src, 0, src.size, terms[self.rank])
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
                in_loc = self._remote(src)
            if gather and not out_loc:
                out_loc = self._remote(dst)
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
                self._collect_results(dst, p, chunk - 1, plan, dt)
            if chunk < plan.chunks:
                self._reduce_part(src, dst, p, chunk, plan, dt, op, gather)

    def _chunk_plan(self, p: int, share: int, counts: list[int], starts: list[int],
                    numel: int, dt: DType, gather: bool) -> _Chunks:
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
                in_remote[i] = (self._peer_pid[i], -loc)
            loc = locs_out[i]
            if loc > 0:
                out_views[i] = self._peer_heaps.view(i, loc, nbytes, st)
            elif loc < 0:
                out_remote[i] = (self._peer_pid[i], -loc)
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
        return _Chunks(share=share, chunks=-(-largest // share) if largest else 0,
                       counts=counts, starts=starts, in_views=in_views, out_views=out_views,
                       publish=gather and not all(locs_out), block=block,
                       in_remote=in_remote, out_remote=out_remote, scratch=scratch,
                       read_in_place=any(locs_in))

    def _stage_inputs(self, src, p: int, chunk: int, share: int, counts: list[int],
                      starts: list[int], dt: DType) -> None:
        """Copy chunk ``chunk`` of every part but ours into our slot, where its reducer
        reads it."""
        mine = self._slots[p][self.rank]
        first = chunk * share
        isz = dt.itemsize
        for j in self._peers:
            length = min(counts[j] - first, share)
            if length > 0:
                _read(src, starts[j] + first, starts[j] + first + length,
                      mine[j * share * isz : (j * share + length) * isz].view(dt.storage))

    def _collect_results(self, dst, p: int, chunk: int, plan: _Chunks, dt: DType) -> None:
        """Copy the peers' reduced parts of chunk ``chunk`` from their slots into ``dst``."""
        first = chunk * plan.share
        results = self.size * plan.share * dt.itemsize  # where a slot's result area starts
        for j in self._peers:
            length = min(plan.counts[j] - first, plan.share)
            if length > 0:
                part = self._slots[p][j][results : results + length * dt.itemsize]
                _write(dst, plan.starts[j] + first, plan.starts[j] + first + length,
                       part.view(dt.storage))

    def _reduce_part(self, src, dst, p: int, chunk: int, plan: _Chunks, dt: DType,
                     op: ReduceOp, gather: bool) -> None:
        """Reduce our part of chunk ``chunk`` in cache-sized blocks and pass each block on
        while it is hot (into our slot's result area, and into peers' heap outputs)."""
        r, n, share = self.rank, self.size, plan.share
        st, isz = dt.storage, dt.itemsize
        first = chunk * share
        length = min(plan.counts[r] - first, share)
        base = plan.starts[r] + first  # the element at offset 0 of our part of the chunk
        staged = self._slots[p]
        result_area = self._slots[p ^ 1][r]  # read by the peers at the next step
        for block_start in range(0, max(length, 0), plan.block):
            block_end = base + min(block_start + plan.block, length)
            for lo, hi, mine in _parts(src, base + block_start, block_end):
                offset, count = lo - base, hi - lo  # inside our part of the chunk
                terms = [mine]
                for i in self._peers:
                    view = plan.in_views[i]
                    if view is not None:
                        terms.append(view[lo:hi])
                    elif plan.in_remote[i] is not None:
                        pid, addr = plan.in_remote[i]
                        got = plan.scratch[i][:count]
                        try:
                            self._xmem.read(pid, addr + lo * isz, got)
                        except DDLPeerError as exc:
                            raise self._lost(i, exc, gather) from None
                        terms.append(got)
                    else:
                        at = (r * share + offset) * isz
                        terms.append(staged[i][at : at + count * isz].view(st))
                if dst is src:
                    out = mine
                elif gather:
                    out = dst[lo:hi]
                else:
                    out = dst[first + offset : first + offset + count]
                reduce_into(out, terms, op, dt, n)
                if plan.publish:
                    at = (n * share + offset) * isz
                    np.copyto(result_area[at : at + count * isz].view(st), out)
                if gather:
                    for j in self._peers:
                        if plan.out_views[j] is not None:
                            np.copyto(plan.out_views[j][lo:hi], out)
                        elif plan.out_remote[j] is not None:
                            pid, addr = plan.out_remote[j]
                            try:
                                self._xmem.write(pid, addr + lo * isz, out)
                            except DDLPeerError as exc:
                                raise self._lost(j, exc, gather) from None

    def _lost(self, i: int, exc: DDLPeerError, gather: bool) -> DDLPeerError:
        """A cross-memory copy with local rank ``i`` failed: it died (or its memory went)
        inside the collective."""
        what = "allreduce" if gather else "reduce_scatter"
        alive = "" if pid_alive(self._peer_pid[i]) else " died;"
        return DDLPeerError(f"{self._me()}: {what}: rank {self._peer_grank[i]}{alive} {exc}")

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
        if self._mm is None:
            return
        try:
            if self._failed is None:
                self._publish_leaving()
        finally:
            self.heap.close()
            self._peer_heaps.close()
            self._step.close()
            self._idents.close()
            self._words = None
            self._q.release()
            self._qb.release()
            self._slots = self._regions = self._staging = None
            self._view_cache.clear()
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with it
            self._mm = None
            if self.rank == 0:
                segments.unlink(self._name)  # in case init failed before the unlink
