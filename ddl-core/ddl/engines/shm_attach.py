"""The shared-memory engine's control segment: its layout, how the local ranks make it and
attach to it, what a rank publishes when it leaves, and the cross-memory agreement.

Layout of the per-job control segment ``ddl-<job>-h<host>-ctl`` (keyed, ``-k<key>``, when the
job has a secret: segments.py)::

    header (4 KiB) | one 2 KiB control block per local rank | staging area

The header says who made the segment for what (``H_*`` words); a control block holds the
rank's step counter, pid, state and global rank (shm_sync) and its metadata and
call-identity records (shm_meta). The staging area holds, per parity, one slot per rank.

Local rank 0 creates the segment (removing one a crashed job with the same id left), the
others map it once its header is written, every rank publishes its pid and waits for the
others, and rank 0 then unlinks the name: nothing can leak, even on SIGKILL. The collective
steps themselves are shm.py's.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable

import numpy as np

from .. import failures
from ..config import SLOT_MIN, show_size
from ..errors import DDLConfigError, DDLError, DDLShmError, DDLTimeoutError
from ..tensors import Pieces
from . import cma as cma_mod
from . import segments
from .shm_sync import (
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
    pid_alive,
    write_reason,
)

_log = logging.getLogger("ddl")
MAGIC = 0x4C44445F4D485344  # "DSHM_DDL"
LAYOUT = 5  # 5: the header carries the one-step bound (H_SMALL)
HDR = 4096  # header bytes
BLOCK = 2048  # control block bytes per local rank
W = BLOCK // 8  # words per control block
# header words
H_MAGIC, H_LAYOUT, H_SIZE, H_SLOT, H_PID, H_READY = range(6)
H_TOKEN = segments.TOKEN_OFFSET // 8  # 6: where every segment carries the job's token
H_SMALL = 7  # DDL_SHM_SMALL_BYTES as local rank 0 read it: up to it a call takes one step


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


# DDL_SHM_SMALL_BYTES=auto. With two ranks on a host the one step and reduce-scatter +
# allgather move the same bytes between them (each reads the other's whole input once);
# the one step spends a second reduction of the whole message where the other spends a
# second synchronisation and two more copies, and wins up to 256 KiB (1.45-2x for numpy
# arrays at 128-256 KiB: benchmarks/shm_one_step.py, docs/performance.md). With more
# ranks the one step reads (ranks - 1) inputs against the other's 2 (ranks - 1) / ranks,
# and 64 KiB stays.
ONE_STEP_BYTES = 64 << 10
ONE_STEP_BYTES_PAIR = 256 << 10


def one_step_bytes(setting: int | str, ranks: int, slot: int) -> int:
    """The largest allreduce the engine makes in one step: DDL_SHM_SMALL_BYTES (``auto``:
    by the ranks on the host), no more than a staging ``slot`` holds."""
    if setting == "auto":
        setting = ONE_STEP_BYTES_PAIR if ranks == 2 else ONE_STEP_BYTES
    return min(int(setting), slot)


class ControlSegment:
    """This rank's mapping of the control segment ``name``: made (local rank 0) or waited
    for (the others) within ``init_timeout`` seconds, then cut into control blocks and
    staging slots. ``attach`` then meets the peers."""

    def __init__(self, name: str, *, job_id: str, token: int, rank: int, size: int,
                 global_rank: int, slot: int, small: int, init_timeout: float):
        self.name = name
        self.job_id = job_id
        self.token = token
        self.rank = rank
        self.size = n = size
        self.global_rank = global_rank
        self.slot_bytes = slot
        self.small_bytes = small
        self.ctl_bytes = HDR + n * BLOCK
        staging_off = -(-self.ctl_bytes // 4096) * 4096
        self.mm: mmap.mmap | None = self._create_or_attach(staging_off + 2 * n * slot,
                                                           init_timeout)
        self.qb = memoryview(self.mm)[: self.ctl_bytes]
        self.q = self.qb.cast("q")
        self.words: np.ndarray | None = np.frombuffer(self.mm, np.int64,
                                                      count=self.ctl_bytes // 8)
        self.staging = np.frombuffer(self.mm, np.uint8, count=2 * n * slot, offset=staging_off)
        # slots[p][i]: local rank i's slot of parity p; regions[p]: every slot of parity p
        self.slots = [
            [self.staging[(p * n + i) * slot : (p * n + i + 1) * slot] for i in range(n)]
            for p in (0, 1)
        ]
        self.regions = [self.staging[p * n * slot : (p + 1) * n * slot] for p in (0, 1)]
        self.blocks = [HDR // 8 + i * W for i in range(n)]
        self.my = self.blocks[rank]
        self.peers = [i for i in range(n) if i != rank]
        self.peer_grank: dict[int, int] = {}
        self.peer_pid: dict[int, int] = {}
        self._probe: np.ndarray | None = None

    # ------------------------------------------------------------------ making
    def _create_or_attach(self, total: int, init_timeout: float) -> mmap.mmap:
        deadline = time.monotonic() + init_timeout
        if self.rank == 0:
            while True:
                try:
                    mm = segments.create(self.name, total, self.token)
                    break
                except FileExistsError:
                    self._remove_stale_or_fail()
            q = memoryview(mm)[:HDR].cast("q")
            q[H_LAYOUT], q[H_SIZE], q[H_SLOT] = LAYOUT, self.size, self.slot_bytes
            q[H_SMALL] = self.small_bytes
            q[H_PID] = os.getpid()
            q[H_TOKEN] = self.token
            q[H_MAGIC] = MAGIC
            q[H_READY] = 1
            q.release()
            return mm
        while True:
            mm = None
            try:
                mm = segments.open_existing(self.name)
                ready = self._check_header(mm)
                if ready and len(mm) >= total:
                    return mm
                # not ready, or mapped between the token's write and the reservation of
                # the rest (segments.create): the file has its full size soon, map it again
                mm.close()
            except DDLError:  # another job's, or other settings: waiting changes nothing
                if mm is not None:
                    mm.close()
                raise
            except (FileNotFoundError, ValueError):  # not there yet, or still empty
                if mm is not None:
                    mm.close()
            if time.monotonic() > deadline:
                raise DDLTimeoutError(
                    f"rank {self.global_rank}: local rank 0 did not create {self.name} within "
                    f"{init_timeout:.0f}s (is local rank 0 running? DDL_INIT_TIMEOUT sets this)"
                )
            time.sleep(0.002)

    def _check_header(self, mm: mmap.mmap) -> bool:
        """Whether local rank 0 finished the header of ``mm``; raises when it did so for
        another job or for other settings."""
        if len(mm) < HDR:  # mapped before the file had its size: map it again
            return False
        q = memoryview(mm)[:HDR].cast("q")
        try:
            if not (q[H_READY] == 1 and q[H_MAGIC] == MAGIC and pid_alive(q[H_PID])):
                return False
            if q[H_TOKEN] != self.token:
                raise DDLShmError(
                    f"rank {self.global_rank}: {segments.SHM_DIR}/{self.name} belongs to "
                    f"another job (its creator, pid {q[H_PID]}, has a different job secret): "
                    f"two jobs share job id {self.job_id!r}; give each its own DDL_JOB_ID "
                    "(ddlrun does)"
                )
            got = (q[H_LAYOUT], q[H_SIZE], q[H_SLOT], q[H_SMALL])
            mine = (LAYOUT, self.size, self.slot_bytes, self.small_bytes)
            if got != mine:
                # a rank that stepped otherwise than its peers would pair unrelated steps
                names = ("ddl's version (shared-memory layout)", "LOCAL_WORLD_SIZE",
                         "DDL_SHM_SLOT_BYTES / DDL_SHM_MAX_BYTES (staging bytes per rank)",
                         "DDL_SHM_SMALL_BYTES")
                k = next(i for i in range(len(mine)) if got[i] != mine[i])
                raise DDLConfigError(
                    f"rank {self.global_rank}: the ranks on this host differ in {names[k]}: "
                    f"local rank 0 made {self.name} with {got[k]}, this rank has {mine[k]}; "
                    "every rank of the job needs the same settings"
                )
            return True
        finally:
            q.release()

    def _remove_stale_or_fail(self) -> None:
        try:
            mm = segments.open_existing(self.name)
        except FileNotFoundError:
            return  # half-made or just removed: try again
        q = memoryview(mm)[:HDR].cast("q")
        pid = q[H_PID]
        q.release()
        mm.close()
        if pid and pid_alive(pid) and pid != os.getpid():
            raise DDLShmError(
                f"rank {self.global_rank}: {segments.SHM_DIR}/{self.name} belongs to a running "
                f"process (pid {pid}): two jobs share job id {self.job_id!r}; give each job its "
                "own DDL_JOB_ID (ddlrun does) or MASTER_PORT"
            )
        segments.unlink(self.name)  # left by a crashed job with the same id

    # ---------------------------------------------------------------- meeting
    def attach(self, init_timeout: float, probe: np.ndarray | None) -> None:
        """Claim this rank's control block, publish its pid (and the address of ``probe``,
        the word its peers read across address spaces, or 0: no cross-memory copies), wait
        until every peer did, and learn their pids and ranks. A peer that never comes
        raises; local rank 0 then removes the named segment."""
        try:
            self._attach(init_timeout, probe)
        except BaseException:
            # it is unlinked only once every rank has attached
            if self.rank == 0:
                segments.unlink(self.name)
            raise

    def _attach(self, init_timeout: float, probe: np.ndarray | None) -> None:
        q, b = self.q, self.my
        other = q[b + W_PID]
        if q[b + W_STATE] != S_NONE and other != os.getpid() and pid_alive(other):
            raise DDLShmError(
                f"rank {self.global_rank}: local rank {self.rank} of {self.name} is already "
                f"taken by pid {other}: two processes claim one rank (two jobs with one "
                "DDL_JOB_ID, or LOCAL_RANK given twice)"
            )
        self._probe = probe  # read by the peers until the agreement step
        q[b + W_PID] = os.getpid()
        q[b + W_GRANK] = self.global_rank
        q[b + W_SEQ] = 0
        q[b + W_CMA] = probe.__array_interface__["data"][0] if probe is not None else 0
        q[b + W_CMA_OK] = 0
        self.publish_state(S_ATTACHED)
        deadline = time.monotonic() + init_timeout
        for i in self.peers:
            while q[self.blocks[i] + W_STATE] == S_NONE:
                if time.monotonic() > deadline:
                    raise DDLTimeoutError(
                        f"rank {self.global_rank}: local rank {i} did not attach to "
                        f"{self.name} within {init_timeout:g}s"
                    )
                time.sleep(0.001)
        self.peer_grank = {i: q[self.blocks[i] + W_GRANK] for i in range(self.size)}
        self.peer_pid = {i: q[self.blocks[i] + W_PID] for i in range(self.size)}
        if self.rank == 0:
            # Every rank has it mapped: drop the name so nothing can leak, even on SIGKILL.
            segments.unlink(self.name)

    # ---------------------------------------------------------------- leaving
    def publish_state(self, state: int) -> None:
        self.q[self.my + W_STATE] = state

    def publish_leaving(self) -> None:
        """What a peer still waiting for this rank is told: that the program called
        ``ddl.shutdown()`` (S_CLOSED), or that this process is exiting, and why (S_EXITING,
        with the uncaught exception when there is one: ddl.failures)."""
        why = failures.leaving()
        if why is None:
            self.publish_state(S_CLOSED)
            return
        write_reason(self.q, self.my, why)
        self.publish_state(S_EXITING)

    def close(self) -> None:
        """Unmap (every view into the segment must be gone: a caller's keeps the mapping
        alive instead) and, on local rank 0, remove the name in case attaching failed."""
        if self.mm is None:
            return
        self.words = None
        self.q.release()
        self.qb.release()
        self.slots = self.regions = self.staging = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with it
        self.mm = None
        if self.rank == 0:
            segments.unlink(self.name)


# ------------------------------------------------------------------ cross memory
def agree_cross_memory(seg: ControlSegment, step: Stepper,
                       xmem: cma_mod.CrossMemory | None) -> cma_mod.CrossMemory | None:
    """One step at start: each rank reads every peer's probe word across address
    spaces; cross-memory copies are used only if every rank read every peer's (a job
    never mixes the paths: a reader whose peer staged nothing would wait forever)."""
    q = seg.q
    # Every rank published its probe's address (0: it does not want cross-memory
    # copies) before attaching: when some rank does not, all know it without a step.
    if seg.size == 1 or any(q[b + W_CMA] == 0 for b in seg.blocks):
        return None
    ok = xmem is not None and all(
        xmem.probe(seg.peer_pid[i], q[seg.blocks[i] + W_CMA],
                   cma_mod.probe_value(seg.token, i))
        for i in seg.peers)
    q[seg.my + W_CMA_OK] = 1 if ok else 2
    s = step.seq + 1
    step.arrive(s)
    step.wait_all(s, ("start-up (cross-memory probe)", "-", 0, None))
    if all(q[b + W_CMA_OK] == 1 for b in seg.blocks):
        return xmem
    if seg.rank == 0:
        _log.debug("[ddl] %s: cross-memory attach unavailable; private buffers are staged",
                   seg.name)
    return None


def remote_location(xmem: cma_mod.CrossMemory | None, arr: np.ndarray | Pieces,
                    reach: Callable[[int, int], bool] | None = None) -> int:
    """The record's location word for a private buffer the peers may reach by
    cross-memory copies (``xmem``: the job agreed on them; ``reach``: whether this buffer
    is worth it, engines/hugepages.py; None: every one): minus its address; 0 where it
    must be staged."""
    if xmem is None or isinstance(arr, Pieces) or not arr.flags.c_contiguous or not arr.nbytes:
        return 0
    addr = arr.__array_interface__["data"][0]
    return -addr if reach is None or reach(addr, arr.nbytes) else 0
