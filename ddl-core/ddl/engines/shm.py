"""The shared-memory engine: collectives among the ranks of one host.

Layout of the per-job control segment ``ddl-<job>-h<host>-ctl``::

    header (4 KiB) | one 512-byte control block per local rank | staging area

A control block holds the rank's *step counter*, pid, state, global rank and two metadata
records (one per parity). The staging area holds, per parity, one slot per rank.

Protocol. Every collective is a sequence of *steps*. In step ``s`` a rank writes only into
the parity ``s % 2`` part of its own slot (and its metadata record), then publishes
``seq = s``, then waits until every peer's counter reaches ``s``, then reads. Because a rank
enters step ``s + 2`` only after every peer published ``s + 1`` (which they do after they
finished reading step ``s``), one monotonically increasing counter per rank replaces all
"done reading" flags: this is double buffering by parity.

Store ordering: data is written before the counter and read after it. That is safe on x86
(stores are not reordered with stores, loads not with loads). On weakly ordered machines
(POWER, aarch64) the counter is written with a release store and read with an acquire load
through libatomic, which orders the data around it.

Algorithms. Small messages take one step: every rank copies its input into its slot and
reduces all inputs itself, in rank order, so every rank computes bitwise the same result.
Larger ones reduce-scatter then allgather in chunks that fit the staging area: rank ``r``
reduces part ``r`` of each chunk and publishes the result, while the next chunk's inputs are
already staged (one synchronisation per chunk). Buffers from ``ddl.malloc`` are read and
written in place by the peers, which removes both copies.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import logging
import mmap
import os
import platform
import threading
import time
from collections.abc import Callable

import numpy as np

from .. import identity
from .. import timeline as _tl
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
from ..runtime import callers_waiting
from ..tensors import Pieces
from . import segments
from .heap import Heap, PeerHeaps

_log = logging.getLogger("ddl")
_MAGIC = 0x4C44445F4D485344  # "DSHM_DDL"
_LAYOUT = 2
_HDR = 4096
_BLOCK = 512
_W = _BLOCK // 8  # words per control block
# header words
H_MAGIC, H_LAYOUT, H_SIZE, H_SLOT, H_PID, H_READY, H_TOKEN = range(7)
# control-block words
W_SEQ, W_PID, W_STATE, W_GRANK, W_SLEEP = 0, 1, 2, 3, 4
W_META = (16, 32)  # metadata record per parity, 16 words each
M_KEY, M_DTYPE, M_COUNT, M_SHAPE, M_ROOT, M_IN, M_OUT, M_NDIM, M_DIMS = range(9)
_MAX_DIMS = 7
# word spans compared across ranks: [lo, hi)
_SPAN_KEY = ((M_KEY, M_KEY + 1),)
_SPAN_REDUCE = ((M_KEY, M_SHAPE + 1),)  # op, dtype, count, shape
_SPAN_GATHER = ((M_KEY, M_DTYPE + 1), (M_SHAPE, M_SHAPE + 1))  # counts may differ
_SPAN_BCAST = ((M_KEY, M_ROOT + 1),)
S_NONE, S_ATTACHED, S_ABORTED, S_CLOSED = 0, 1, 2, 3

BARRIER, ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_SCATTER = 1, 2, 3, 4, 5
_COLL_NAMES = {1: "barrier", 2: "allreduce", 3: "allgather", 4: "broadcast", 5: "reduce_scatter"}


def _key(coll: int, op: int = 0) -> int:
    return coll * 16 + op


def _describe_key(key: int) -> str:
    coll, op = divmod(key, 16)
    name = _COLL_NAMES.get(coll, f"op#{coll}")
    return f"{name}({ReduceOp(op).name.title()})" if op else name


def _shape_hash(shape: tuple[int, ...]) -> int:
    return hash(tuple(int(d) for d in shape)) & ((1 << 62) - 1)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # state is the field after "(comm)"; a zombie has exited already.
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (FileNotFoundError, IndexError):
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


def _weakly_ordered() -> bool:
    return platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86")


class _Atomics:
    """Release stores / acquire loads of 8-byte words through libatomic (non-x86)."""

    def __init__(self, mm: mmap.mmap):
        path = ctypes.util.find_library("atomic")
        if not path:
            raise DDLShmError(
                "this CPU is weakly ordered and libatomic was not found; install libatomic1 "
                "(the shared-memory engine needs release/acquire counters here)"
            )
        lib = ctypes.CDLL(path)
        self._store = getattr(lib, "__atomic_store_8")  # (no name mangling)
        self._store.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        self._store.restype = None
        self._load = getattr(lib, "__atomic_load_8")
        self._load.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._load.restype = ctypes.c_int64
        self._anchor = ctypes.c_char.from_buffer(mm)
        self._base = ctypes.addressof(self._anchor)

    def store(self, word: int, value: int) -> None:
        self._store(self._base + 8 * word, value, 3)  # __ATOMIC_RELEASE

    def load(self, word: int) -> int:
        return self._load(self._base + 8 * word, 2)  # __ATOMIC_ACQUIRE

    def close(self) -> None:
        del self._anchor


_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221,
              "ppc64": 221, "s390x": 238, "riscv64": 98}.get(platform.machine().lower())


class _Futex:
    """Sleep in the kernel until a peer's counter moves (FUTEX_WAIT on its low 32 bits).

    When ranks outnumber cores, spinning or yielding wastes the core the late peer needs;
    a futex hands it over and the arriving rank wakes the sleepers.
    """

    def __init__(self, mm: mmap.mmap):
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._anchor = ctypes.c_char.from_buffer(mm)
        self._base = ctypes.addressof(self._anchor) + (0 if _LITTLE else 4)
        self._ts = _Timespec(0, 2_000_000)  # re-check liveness every 2 ms at most
        self._ts_ref = ctypes.byref(self._ts)

    def wait(self, word: int, seen: int) -> None:
        v = seen & 0xFFFFFFFF
        if v >= 1 << 31:
            v -= 1 << 32
        self._syscall(_SYS_FUTEX, ctypes.c_void_p(self._base + 8 * word), 0, ctypes.c_int(v),
                      self._ts_ref, None, 0)

    def wake(self, word: int) -> None:
        self._syscall(_SYS_FUTEX, ctypes.c_void_p(self._base + 8 * word), 1,
                      ctypes.c_int(0x7FFFFFFF), None, None, 0)

    def close(self) -> None:
        del self._anchor


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_LITTLE = __import__("sys").byteorder == "little"
_MAIN_THREAD = threading.main_thread()


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
    ):
        """``dump_iter``: every this many allreduces, rank 0 logs their time (``-dump_iter``
        of a job on one host; in a multi-host job the multi-dimensional engine does)."""
        if not 0 <= local_rank < local_size:
            raise DDLConfigError(f"local rank {local_rank} is outside 0..{local_size - 1}")
        self.job_id = segments.validate_job_id(job_id)
        self.host_index = host_index
        self.rank = local_rank
        self.size = n = local_size
        self.global_rank = global_rank
        self.timeout = float(timeout)
        # marks the segment as this job's: a rank never joins a segment of another job
        self._token = token if token is not None else identity.segment_token(
            job_id, identity.job_secret())
        slot = min(slot_bytes, max_bytes // (2 * n))
        slot = slot // 4096 * 4096
        if slot < 64 << 10:
            raise DDLConfigError(
                f"DDL_SHM_MAX_BYTES={max_bytes} leaves {slot} bytes of staging per rank for "
                f"{n} ranks; it needs at least 64 KiB per rank and parity "
                f"(DDL_SHM_MAX_BYTES >= {2 * n * (64 << 10)})"
            )
        self.slot_bytes = slot
        self.small_bytes = min(small_bytes, slot)
        self.block_bytes = block_bytes
        if hasattr(os, "sched_getaffinity"):
            ncores = len(os.sched_getaffinity(0))
        else:
            ncores = os.cpu_count()
        if wait_policy == "auto":
            wait_policy = "futex" if n > (ncores or 1) else "spin"
        self.wait_policy = wait_policy
        # spin: poll ~2000 times before yielding; yield: give the core away at once (ranks
        # outnumber cores); futex: sleep almost at once. All end in a futex sleep.
        self._spin, self._yields = {"spin": (2000, 64), "yield": (0, 64), "futex": (0, 2)}[
            wait_policy
        ]
        self._failed: BaseException | None = None
        self._seq = 0
        self._dump_iter = dump_iter
        self._calls = 0
        self._wall = 0.0
        # scope tells apart the engines of one rank (one per grid line in a multi-host job)
        self._name = segments.segment_name(job_id, host_index, f"{scope}ctl")
        self._ctl_bytes = _HDR + n * _BLOCK
        staging_off = -(-self._ctl_bytes // 4096) * 4096
        total = staging_off + 2 * n * slot
        self._mm = self._create_or_attach(total, init_timeout)
        self._qb = memoryview(self._mm)[: self._ctl_bytes]
        self._q = self._qb.cast("q")
        self._meta_cache: dict[tuple, memoryview] = {}
        self._view_cache: dict[tuple, tuple] = {}
        weak = _weakly_ordered() if fences is None else fences
        self._atomics = _Atomics(self._mm) if weak else None
        self._futex = _Futex(self._mm) if _SYS_FUTEX is not None else None
        self._staging = np.frombuffer(self._mm, np.uint8, count=2 * n * slot, offset=staging_off)
        self._slots = [
            [self._staging[(p * n + i) * slot : (p * n + i + 1) * slot] for i in range(n)]
            for p in (0, 1)
        ]
        self._regions = [self._staging[p * n * slot : (p + 1) * n * slot] for p in (0, 1)]
        self._blk = [_HDR // 8 + i * _W for i in range(n)]
        self._my = self._blk[local_rank]
        self._peers = [i for i in range(n) if i != local_rank]
        self._peer_seq = [(i, self._blk[i] + W_SEQ) for i in self._peers]
        self._peer_sleep = [self._blk[i] + W_SLEEP for i in self._peers]
        self.heap = Heap(job_id, host_index, local_rank, heap_bytes, scope)
        self._peer_heaps = PeerHeaps(job_id, host_index, scope)
        try:
            self._attach(init_timeout)
        except BaseException:
            # a peer never came: do not leave the named segment behind (it is unlinked
            # only once every rank has attached)
            if self.rank == 0:
                segments.unlink(self._name)
            raise

    # ------------------------------------------------------------------ setup
    def _create_or_attach(self, total: int, init_timeout: float) -> mmap.mmap:
        deadline = time.monotonic() + init_timeout
        if self.rank == 0:
            while True:
                try:
                    mm = segments.create(self._name, total)
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
                ok = q[H_READY] == 1 and q[H_MAGIC] == _MAGIC and _pid_alive(q[H_PID])
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
                    return mm
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
        if pid and _pid_alive(pid) and pid != os.getpid():
            raise DDLShmError(
                f"rank {self.global_rank}: {segments.SHM_DIR}/{self._name} belongs to a running "
                f"process (pid {pid}): two jobs share job id {self.job_id!r}; give each job its "
                "own DDL_JOB_ID (ddlrun does) or MASTER_PORT"
            )
        segments.unlink(self._name)  # left by a crashed job with the same id

    def _attach(self, init_timeout: float) -> None:
        q, b = self._q, self._my
        other = q[b + W_PID]
        if q[b + W_STATE] != S_NONE and other != os.getpid() and _pid_alive(other):
            raise DDLShmError(
                f"rank {self.global_rank}: local rank {self.rank} of {self._name} is already "
                f"taken by pid {other}: two processes claim one rank (two jobs with one "
                "DDL_JOB_ID, or LOCAL_RANK given twice)"
            )
        q[b + W_PID] = os.getpid()
        q[b + W_GRANK] = self.global_rank
        q[b + W_SEQ] = 0
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

    def _publish_state(self, state: int) -> None:
        self._q[self._my + W_STATE] = state

    # ------------------------------------------------------------- stepping
    def _arrive(self, seq: int) -> None:
        if self._atomics is None:
            self._q[self._my + W_SEQ] = seq
        else:
            self._atomics.store(self._my + W_SEQ, seq)
        self._seq = seq
        if self._futex is not None:
            q = self._q
            for w in self._peer_sleep:
                if q[w]:
                    self._futex.wake(self._my + W_SEQ)
                    break

    def _wait_all(self, seq: int, what: tuple) -> None:
        q = self._q
        if self._atomics is None:
            for i, w in self._peer_seq:
                if q[w] < seq:
                    self._wait_slow(i, w, seq, what)
        else:
            for i, w in self._peer_seq:
                if self._atomics.load(w) < seq:
                    self._wait_slow(i, w, seq, what)

    def _wait_slow(self, peer: int, word: int, seq: int, what: tuple) -> None:
        """Spin, then yield, then sleep on a futex until the peer's counter reaches seq.
        Liveness and the timeout are checked every few milliseconds throughout."""
        load = self._q.__getitem__ if self._atomics is None else self._atomics.load
        n = 0
        spin, yields = self._spin, self._yields
        if threading.current_thread() is not _MAIN_THREAD and not callers_waiting():
            # Collectives off the main thread (async handles, DDP's comm hook, pipelines)
            # run beside the user's compute: spinning would take the core it needs. Unless
            # the caller is blocked waiting for them, which leaves its core idle.
            spin, yields = 0, 2
        while n < spin:
            if load(word) >= seq:
                return
            n += 1
        t0 = time.monotonic()
        next_probe = t0 + 0.002
        futex = self._futex
        q, flag = self._q, self._my + W_SLEEP
        k = 0
        traced = _tl.clock() if _tl.recorder is not None else 0.0
        while True:
            v = load(word)
            if v >= seq:
                if traced:
                    _tl.phase("peer wait", "wait", traced, _tl.clock(),
                              {"peer": self._peer_grank[peer], "step": seq, "in": what[0]})
                return
            k += 1
            if futex is None or k <= yields:
                os.sched_yield()
                if k & 15:
                    continue
            else:
                q[flag] = 1  # tells the peer to wake us when it arrives
                if load(word) == v:
                    futex.wait(word, v)
                q[flag] = 0
            now = time.monotonic()
            if now >= next_probe:
                self._probe(peer, word, seq, what, now - t0)
                next_probe = now + 0.01
                if futex is None and now - t0 > 0.02:
                    time.sleep(0.0002)  # no futex on this OS: at least do not burn a core

    def _probe(self, peer: int, word: int, seq: int, what: tuple, waited: float) -> None:
        q = self._q
        if q[word] >= seq:
            return  # it arrived (and may have exited since): nothing is wrong
        b = self._blk[peer]
        state = q[b + W_STATE]
        peer_name = f"rank {self._peer_grank[peer]}"
        if state == S_ABORTED:
            raise DDLPeerError(f"{self._me()}: {peer_name} aborted during {self._what(what)}")
        if state == S_CLOSED:
            raise DDLPeerError(
                f"{self._me()}: {peer_name} called ddl.shutdown() while this rank waits in "
                f"{self._what(what)}"
            )
        pid = self._peer_pid[peer]
        if not _pid_alive(pid):
            raise DDLPeerError(
                f"{self._me()}: {peer_name} (pid {pid}) died during {self._what(what)}"
            )
        if waited > self.timeout:
            raise DDLTimeoutError(
                f"{self._me()}: {self._what(what)} timed out after {self.timeout:g}s waiting for "
                f"{peer_name} (it is at step {q[b + W_SEQ]}, this step is {seq}); is it stuck "
                "or running a different collective? (DDL_TIMEOUT sets the limit)"
            )

    def _me(self) -> str:
        return f"rank {self.global_rank}"

    @staticmethod
    def _what(what: tuple) -> str:
        coll, dtype, count, op = what
        s = f"{coll}({dtype}[{count}]"
        return s + (f", {op.name.title()})" if op else ")")

    def _write_meta(self, p: int, key: int, dt: DType | None, count: int, shape: tuple,
                    root: int = 0, in_loc: int = 0, out_loc: int = 0) -> None:
        ck = (key, dt.code if dt is not None else 0, count, shape, root, in_loc, out_loc)
        words = self._meta_cache.get(ck)
        if words is None:
            dims = [int(d) for d in shape[:_MAX_DIMS]]
            rec = [ck[0], ck[1], count, _shape_hash(shape), root, in_loc, out_loc, len(shape)]
            rec += dims + [0] * (_MAX_DIMS - len(dims))
            words = memoryview(array.array("q", rec + [0] * (16 - len(rec))))
            if len(self._meta_cache) > 1024:
                self._meta_cache.clear()
            self._meta_cache[ck] = words
        m = self._my + W_META[p]
        self._q[m : m + 16] = words

    def _meta(self, i: int, p: int, field: int) -> int:
        return self._q[self._blk[i] + W_META[p] + field]

    def _check_meta(self, p: int, spans: tuple[tuple[int, int], ...], what: tuple) -> None:
        """Raise DDLMismatchError on every rank if any peer's record differs from ours in
        the given word spans. All ranks read the same records, so all raise together."""
        qb = self._qb
        off = W_META[p] * 8
        mine = self._my * 8 + off
        for lo, hi in spans:
            ref = qb[mine + lo * 8 : mine + hi * 8].tobytes()
            for i in self._peers:
                b = self._blk[i] * 8 + off
                if qb[b + lo * 8 : b + hi * 8] != ref:
                    raise DDLMismatchError(self._mismatch_report(p, what))

    def _mismatch_report(self, p: int, what: tuple) -> str:
        from ..dtypes import BY_CODE

        lines = []
        for i in range(self.size):
            b = self._blk[i] + W_META[p]
            q = self._q
            nd = q[b + M_NDIM]
            dims = [q[b + M_DIMS + k] for k in range(min(nd, _MAX_DIMS))]
            shape = "x".join(map(str, dims)) + ("x..." if nd > _MAX_DIMS else "")
            dt = BY_CODE.get(q[b + M_DTYPE])
            root = q[b + M_ROOT]
            lines.append(
                f"  rank {self._peer_grank[i]}: {_describe_key(q[b + M_KEY])} "
                f"{dt.name if dt else '-'}[{shape or 'scalar'}] root/extra={root}"
            )
        return (
            f"{self._me()}: ranks called {what[0]} with different arguments "
            "(every rank must pass the same op, dtype and shape):\n" + "\n".join(lines)
        )

    def _run(self, fn: Callable, *args):
        if self._failed is not None:
            raise DDLError(
                f"{self._me()}: the shared-memory engine failed earlier ({self._failed}); "
                "the job cannot continue"
            )
        try:
            return fn(*args)
        except DDLMismatchError:
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
        s = self._seq + 1
        p = s & 1
        self._write_meta(p, _key(BARRIER), None, 0, ())
        self._arrive(s)
        what = ("barrier", "-", 0, None)
        self._wait_all(s, what)
        self._check_meta(p, _SPAN_KEY, what)

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

    def _small_views(self, p: int, nbytes: int, st: np.dtype) -> tuple[np.ndarray, list]:
        key = (p, nbytes, st)
        v = self._view_cache.get(key)
        if v is None:
            slots = self._slots[p]
            v = (slots[self.rank][:nbytes], [slots[i][:nbytes].view(st) for i in range(self.size)])
            if len(self._view_cache) > 256:
                self._view_cache.clear()
            self._view_cache[key] = v
        return v

    def _allreduce_small(self, src, dst, dt: DType, op: ReduceOp, shape) -> None:
        s = self._seq + 1
        p = s & 1
        mine, terms = self._small_views(p, src.nbytes, dt.storage)
        _read(src, 0, src.size, terms[self.rank])
        self._write_meta(p, _key(ALLREDUCE, op), dt, src.size, shape)
        self._arrive(s)
        what = ("allreduce", dt.name, src.size, op)
        self._wait_all(s, what)
        self._check_meta(p, _SPAN_REDUCE, what)
        if isinstance(dst, Pieces):
            for lo, hi, out in dst.cuts(0, dst.size):
                reduce_into(out, [t[lo:hi] for t in terms], op, dt, self.size)
        else:
            reduce_into(dst, terms, op, dt, self.size)

    def _reduce_scatter_steps(self, coll: int, src, dst, dt: DType, op: ReduceOp, shape,
                              counts: list[int]) -> None:
        n, r = self.size, self.rank
        N = src.size
        st = dt.storage
        isz = dt.itemsize
        what = (_COLL_NAMES[coll], dt.name, N, op)
        gather = coll == ALLREDUCE
        elems = self.slot_bytes // isz
        c = elems // (n + 1)  # per-rank share of a chunk when staged
        if c >= 64:
            c -= c % 64
        starts = [0] * n
        for j in range(1, n):
            starts[j] = starts[j - 1] + counts[j - 1]
        # Step 1 stages chunk 0 (if our input is private) and carries the metadata: shapes
        # are checked and buffer locations exchanged before anything else depends on them.
        s = self._seq + 1
        p = s & 1
        in_loc = 0 if isinstance(src, Pieces) else self.heap.locate(src)
        out_loc = self.heap.locate(dst) if gather and not isinstance(dst, Pieces) else 0
        if not in_loc:
            self._stage_inputs(src, p, 0, c, counts, starts, st, isz)
        self._write_meta(p, _key(coll, op), dt, N, shape, 0, in_loc, out_loc)
        self._arrive(s)
        self._wait_all(s, what)
        self._check_meta(p, _SPAN_REDUCE, what)
        locs_in = [self._meta(i, p, M_IN) for i in range(n)]
        locs_out = [self._meta(i, p, M_OUT) for i in range(n)]
        in_views: list[np.ndarray | None] = [None] * n
        out_views: list[np.ndarray | None] = [None] * n
        for i in self._peers:
            if locs_in[i]:
                in_views[i] = self._peer_heaps.view(i, locs_in[i], N * isz, st)
            if gather and locs_out[i]:
                out_views[i] = self._peer_heaps.view(i, locs_out[i], N * isz, st)
        need_res = gather and not all(locs_out)
        if all(locs_in) and (not gather or all(locs_out)):
            c = max(1, max(counts))  # nothing is staged: one chunk, reduced block by block
        K = -(-max(counts) // c) if max(counts) else 0
        blk = max(1, self.block_bytes // isz)
        own_in_private = locs_in[r] == 0
        own_out_private = gather and locs_out[r] == 0
        rc = counts[r]
        extra = 0 if gather or not any(locs_in) else 1  # peers may read our heap to the end
        for t in range(K + (1 if gather else 0) + extra):
            if t:  # step 1 above was chunk 0's synchronisation
                s += 1
                p = s & 1
                if t < K and own_in_private:
                    self._stage_inputs(src, p, t, c, counts, starts, st, isz)
                self._arrive(s)
                self._wait_all(s, what)
            if gather and t >= 1 and own_out_private:
                a = (t - 1) * c
                for j in self._peers:
                    ln = min(counts[j] - a, c)
                    if ln > 0:
                        res = self._slots[p][j][n * c * isz : (n * c + ln) * isz].view(st)
                        _write(dst, starts[j] + a, starts[j] + a + ln, res)
            if t < K:
                a = t * c
                ln = min(rc - a, c)
                # Reduce in cache-sized blocks and pass each block on while it is hot.
                base = starts[r] + a  # element at offset 0 of our part of the chunk
                for b0 in range(0, max(ln, 0), blk):
                    for lo, hi, mine in _parts(src, base + b0, base + min(b0 + blk, ln)):
                        k, bl = lo - base, hi - lo  # k: offset inside our part of the chunk
                        terms = [mine]
                        for i in self._peers:
                            if in_views[i] is not None:
                                terms.append(in_views[i][lo:hi])
                            else:
                                o = (r * c + k) * isz
                                terms.append(self._slots[p][i][o : o + bl * isz].view(st))
                        if dst is src:
                            out = mine
                        else:
                            out = dst[lo:hi] if gather else dst[a + k : a + k + bl]
                        reduce_into(out, terms, op, dt, n)
                        if need_res:
                            o = (n * c + k) * isz
                            np.copyto(self._slots[p ^ 1][r][o : o + bl * isz].view(st), out)
                        if gather:
                            for j in self._peers:
                                if out_views[j] is not None:
                                    np.copyto(out_views[j][lo:hi], out)

    def _stage_inputs(self, src, p: int, t: int, c: int, counts, starts, st, isz) -> None:
        """Copy chunk t of every part but ours into our slot, where its reducer reads it."""
        mine = self._slots[p][self.rank]
        a = t * c
        for j in self._peers:
            ln = min(counts[j] - a, c)
            if ln > 0:
                _read(src, starts[j] + a, starts[j] + a + ln,
                      mine[j * c * isz : (j * c + ln) * isz].view(st))

    def allgather(self, src: np.ndarray, dt: DType, row_shape: tuple[int, ...],
                  alloc: Callable[[list[int]], np.ndarray]) -> np.ndarray:
        """Concatenate every rank's ``src`` (rows of ``row_shape``; counts may differ).
        ``alloc(counts)`` returns the flat output once the element counts are known."""
        return self._run(self._allgather, src, dt, row_shape, alloc)

    def _allgather(self, src, dt: DType, row_shape, alloc) -> np.ndarray:
        n, r = self.size, self.rank
        st = dt.storage
        isz = dt.itemsize
        E = self.slot_bytes // isz
        s = self._seq + 1
        p = s & 1
        N = src.size
        what = ("allgather", dt.name, N, None)
        first = min(N, E)
        np.copyto(self._slots[p][r][: first * isz].view(st), src[:first])
        self._write_meta(p, _key(ALLGATHER), dt, N, row_shape)
        self._arrive(s)
        self._wait_all(s, what)
        self._check_meta(p, _SPAN_GATHER, what)
        counts = [self._meta(i, p, M_COUNT) for i in range(n)]
        dst = alloc(counts)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        K = max(1, -(-max(counts) // E))
        for t in range(K):
            if t:
                s += 1
                p = s & 1
                a = t * E
                ln = min(N - a, E)
                if ln > 0:
                    np.copyto(self._slots[p][r][: ln * isz].view(st), src[a : a + ln])
                self._arrive(s)
                self._wait_all(s, what)
            a = t * E
            for i in range(n):
                ln = min(counts[i] - a, E)
                if ln <= 0:
                    continue
                o = starts[i] + a
                if i == r:
                    np.copyto(dst[o : o + ln], src[a : a + ln])
                else:
                    np.copyto(dst[o : o + ln], self._slots[p][i][: ln * isz].view(st))
        return dst

    def broadcast(self, buf: np.ndarray, dt: DType, root: int, shape: tuple[int, ...]) -> None:
        """buf on every rank = buf on local rank ``root``."""
        self._run(self._broadcast, buf, dt, root, shape)

    def _broadcast(self, buf, dt: DType, root: int, shape) -> None:
        st = dt.storage
        isz = dt.itemsize
        R = len(self._regions[0]) // isz  # the root may use the whole parity region
        N = buf.size
        K = max(1, -(-N // R))
        what = ("broadcast", dt.name, N, None)
        s = self._seq
        for t in range(K):
            s += 1
            p = s & 1
            a = t * R
            ln = min(N - a, R)
            region = self._regions[p]
            if self.rank == root and ln > 0:
                np.copyto(region[: ln * isz].view(st), buf[a : a + ln])
            if t == 0:
                self._write_meta(p, _key(BROADCAST), dt, N, shape, root)
            self._arrive(s)
            self._wait_all(s, what)
            if t == 0:
                self._check_meta(p, _SPAN_BCAST, what)
            if self.rank != root and ln > 0:
                np.copyto(buf[a : a + ln], region[: ln * isz].view(st))

    # -------------------------------------------------------------- teardown
    def close(self) -> None:
        if self._mm is None:
            return
        try:
            if self._failed is None:
                self._publish_state(S_CLOSED)
        finally:
            self.heap.close()
            self._peer_heaps.close()
            if self._atomics is not None:
                self._atomics.close()
            if self._futex is not None:
                self._futex.close()
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
