"""Step synchronisation of the shared-memory engine: counters, futex, wait policy, liveness.

Each local rank owns one control block in the engine's control segment (layout below). A
collective is a sequence of *steps*: a rank writes what it shares for step ``s``, then
*arrives* (publishes ``seq = s``), then *waits* until every peer's counter reaches ``s``.

Store ordering: data is written before the counter and read after it. That is safe on x86
(stores are not reordered with stores, loads not with loads). On weakly ordered machines
(POWER, aarch64) the counter is written with a release store and read with an acquire load
through libatomic, which orders the data around it.

Waiting: spin (when every rank has a core), then yield, then sleep on a futex on the peer's
counter; the arriving rank wakes sleepers. Liveness (the peer's state word and pid) and the
timeout are probed every few milliseconds, so a dead or stuck peer raises, never hangs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import sys
import threading
import time
from collections.abc import Callable

from .. import flight as _fl
from .. import timeline as _tl
from ..errors import DDLPeerError, DDLShmError, DDLTimeoutError

# control-block words (the metadata records of shm_meta follow them in the same block)
W_SEQ, W_PID, W_STATE, W_GRANK, W_SLEEP = 0, 1, 2, 3, 4
# cross-memory attach (engines/cma.py): the address of this rank's probe word, and whether
# it read every peer's (1) or not (2)
W_CMA, W_CMA_OK = 5, 6
# the state word; S_EXITING: the rank's process is leaving (its script ended, or an uncaught
# exception ends it: ddl.failures), not its program's own ddl.shutdown() (S_CLOSED)
S_NONE, S_ATTACHED, S_ABORTED, S_CLOSED, S_EXITING = 0, 1, 2, 3, 4
# why an S_EXITING rank leaves: its length in bytes, then the UTF-8 text (the last words of
# the control block, after the call-identity records of shm_meta)
W_REASON = 240
REASON_BYTES = 8 * 15
# wait policy -> (polls before yielding, yields before sleeping on the futex). spin: every
# rank has a core; yield: ranks outnumber cores, give it away at once; futex: sleep at once.
POLICIES = {"spin": (2000, 64), "yield": (0, 64), "futex": (0, 2)}

_LITTLE = sys.byteorder == "little"
_MAIN_THREAD = threading.main_thread()
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221,
              "ppc64": 221, "s390x": 238, "riscv64": 98}.get(platform.machine().lower())


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited already); unknown pids count as alive."""
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
            # state is the field after "(comm)"
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except ProcessLookupError:
        # the process was reaped between open() and read(): the kernel answers ESRCH
        return False
    except (FileNotFoundError, IndexError):
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


def write_reason(q: memoryview, block: int, text: str) -> None:
    """Put why this rank leaves into its control block (``block``: its first word), cut to
    ``REASON_BYTES`` at a character boundary; written before the state word says
    S_EXITING."""
    data = text.encode("utf-8", "replace")[:REASON_BYTES].decode("utf-8", "ignore").encode()
    padded = data.ljust(REASON_BYTES, b"\0")
    for i in range(REASON_BYTES // 8):
        q[block + W_REASON + 1 + i] = int.from_bytes(padded[8 * i : 8 * i + 8], "little",
                                                     signed=True)
    q[block + W_REASON] = len(data)


def read_reason(q: memoryview, block: int) -> str:
    """What ``write_reason`` put into ``block``'s words ("" when nothing)."""
    n = q[block + W_REASON]
    if not 0 < n <= REASON_BYTES:
        return ""
    raw = b"".join(q[block + W_REASON + 1 + i].to_bytes(8, "little", signed=True)
                   for i in range(REASON_BYTES // 8))
    return raw[:n].decode("utf-8", "replace")


def weakly_ordered() -> bool:
    return platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86")


def default_policy(ranks: int) -> str:
    """``auto``: spin while every rank has a core, sleep on a futex when they outnumber."""
    if hasattr(os, "sched_getaffinity"):
        ncores = len(os.sched_getaffinity(0))
    else:
        ncores = os.cpu_count()
    return "futex" if ranks > (ncores or 1) else "spin"


class Atomics:
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


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
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


def describe(what: tuple) -> str:
    """``what`` = (collective, dtype name, count, op or None) as the error messages say it."""
    coll, dtype, count, op = what
    s = f"{coll}({dtype}[{count}]"
    return s + (f", {op.name.title()})" if op else ")")


class Stepper:
    """This rank's step counter and its waits on the peers' counters.

    ``q``: the control segment as int64 words; ``blocks``: the first word of each local
    rank's control block; ``granks``/``pids``: each local rank's job rank and pid (for the
    messages and the liveness probe); ``callers_waiting``: whether some thread is blocked
    waiting for the collective this one runs (ddl.runtime's count, passed in)."""

    def __init__(self, mm: mmap.mmap, q: memoryview, blocks: list[int], rank: int, *,
                 granks: dict[int, int], pids: dict[int, int], timeout: float,
                 policy: str, fences: bool, callers_waiting: Callable[[], bool]):
        self.seq = 0  # the last step this rank arrived at
        self.timeout = timeout
        self._callers_waiting = callers_waiting
        self._q = q
        self._blk = blocks
        self._my = blocks[rank]
        self._grank = granks
        self._pid = pids
        self._me = f"rank {granks[rank]}"
        peers = [i for i in range(len(blocks)) if i != rank]
        self._peer_seq = [(i, blocks[i] + W_SEQ) for i in peers]
        self._peer_sleep = [blocks[i] + W_SLEEP for i in peers]
        self._spin, self._yields = POLICIES[policy]
        self._atomics = Atomics(mm) if fences else None
        self._futex = Futex(mm) if _SYS_FUTEX is not None else None

    def arrive(self, seq: int) -> None:
        """Publish step ``seq`` (everything this rank shares for it is written already)."""
        if self._atomics is None:
            self._q[self._my + W_SEQ] = seq
        else:
            self._atomics.store(self._my + W_SEQ, seq)
        self.seq = seq
        if self._futex is not None:
            q = self._q
            for w in self._peer_sleep:
                if q[w]:
                    self._futex.wake(self._my + W_SEQ)
                    break

    def wait_all(self, seq: int, what: tuple) -> None:
        """Return once every peer arrived at ``seq``; raise if one died, aborted or stalls."""
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
        polls = 0
        spin, yields = self._spin, self._yields
        if threading.current_thread() is not _MAIN_THREAD and not self._callers_waiting():
            # Collectives off the main thread (async handles, DDP's comm hook, pipelines)
            # run beside the user's compute: spinning would take the core it needs. Unless
            # the caller is blocked waiting for them, which leaves its core idle.
            spin, yields = 0, 2
        while polls < spin:
            if load(word) >= seq:
                return
            polls += 1
        t0 = time.monotonic()
        next_probe = t0 + 0.002
        futex = self._futex
        q, flag = self._q, self._my + W_SLEEP
        rounds = 0
        probed = False
        traced = _tl.clock() if _tl.recorder is not None else 0.0
        while True:
            seen = load(word)
            if seen >= seq:
                if probed:
                    _fl.end_wait()
                if traced:
                    _tl.phase("peer wait", "wait", traced, _tl.clock(),
                              {"peer": self._grank[peer], "step": seq, "in": what[0]})
                return
            rounds += 1
            if futex is None or rounds <= yields:
                os.sched_yield()
                if rounds & 15:
                    continue
            else:
                q[flag] = 1  # tells the peer to wake us when it arrives
                if load(word) == seen:
                    futex.wait(word, seen)
                q[flag] = 0
            now = time.monotonic()
            if now >= next_probe:
                probed = True
                self._probe(peer, word, seq, what, now - t0)
                next_probe = now + 0.01
                if futex is None and now - t0 > 0.02:
                    time.sleep(0.0002)  # no futex on this OS: at least do not burn a core

    def _probe(self, peer: int, word: int, seq: int, what: tuple, waited: float) -> None:
        q = self._q
        if q[word] >= seq:
            return  # it arrived (and may have exited since): nothing is wrong
        b = self._blk[peer]
        _fl.note_wait(self._grank[peer], seq, q[b + W_SEQ], time.monotonic() - waited)
        state = q[b + W_STATE]
        peer_name = f"rank {self._grank[peer]}"
        if state == S_ABORTED:
            raise DDLPeerError(f"{self._me}: {peer_name} aborted during {describe(what)}")
        if state == S_CLOSED:
            raise DDLPeerError(
                f"{self._me}: {peer_name} called ddl.shutdown() while this rank waits in "
                f"{describe(what)}"
            )
        if state == S_EXITING:
            why = read_reason(self._q, b) or "no exception: its script ended or called exit()"
            raise DDLPeerError(f"{self._me}: {peer_name}'s process is exiting ({why}) while "
                               f"this rank waits in {describe(what)}")
        pid = self._pid[peer]
        if not pid_alive(pid):
            raise DDLPeerError(f"{self._me}: {peer_name} (pid {pid}) died during {describe(what)}")
        if waited > self.timeout:
            raise DDLTimeoutError(
                f"{self._me}: {describe(what)} timed out after {self.timeout:g}s waiting for "
                f"{peer_name} (it is at step {q[b + W_SEQ]}, this step is {seq}); is it stuck "
                "or running a different collective? (DDL_TIMEOUT sets the limit)"
            )

    def close(self) -> None:
        if self._atomics is not None:
            self._atomics.close()
        if self._futex is not None:
            self._futex.close()
