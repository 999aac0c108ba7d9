"""Cross-memory attach: the shared-memory engine's peers read and write a rank's *private*
buffers directly (``process_vm_readv`` / ``process_vm_writev``), as Open MPI's CMA
single-copy path does, instead of staging them through the shared slots.

A buffer that is not in ddl's shared heap (a DDP bucket, any tensor the program made) then
costs one kernel copy per reader and no synchronisation per chunk: the same walk as a heap
buffer, two synchronisations for the whole call. Which buffers take it is
``DDL_SHM_CMA``'s: ``auto`` (the default) those on transparent huge pages, where it is
1.1-1.4x faster than staging at 16-64 MiB (calls back to back: 0.8-2x); on 4 KiB pages
(torch's allocator) every page pinned makes it slower than staging (engines/hugepages.py,
docs/performance.md).

The kernel allows it only where the reader may already ptrace the owner (same user and no
Yama restriction, or CAP_SYS_PTRACE; container seccomp profiles often refuse it): nothing
here widens that. The engine probes it once at start on every pair of local ranks and every
rank uses it only when all probes passed (``ShmEngine``), so a job never mixes the paths.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np

from ..errors import DDLPeerError

# Below this many bytes a call stages its private buffers even where cross-memory copies
# are allowed: the kernel's copy (about 5 GB/s here, pinning every page) loses to two
# user-space copies on messages that fit the caches. benchmarks/shm_cma.py, 2 ranks:
# 0.8-0.9x of staging at 1-2 MiB, 0.94-1.01x at 4 MiB, 1.1-1.3x from 8 MiB.
MIN_BYTES = 8 << 20
# Elements read from a peer per call: 1 MiB measured 1.1-1.3x faster than 256 KiB at
# 16-42 MiB (fewer calls, each pinning more pages), and still fits a core's L2 cache.
BLOCK_BYTES = 1 << 20


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind(libc: ctypes.CDLL, name: str):
    fn = getattr(libc, name)
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


class CrossMemory:
    """Copies between this process and another one's address space. One instance per
    engine: its two iovec pairs are reused by every call (the engine calls from one
    thread)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._readv = _bind(libc, "process_vm_readv")
        self._writev = _bind(libc, "process_vm_writev")
        self._local = _IOVec()
        self._remote = _IOVec()
        self._lp = ctypes.byref(self._local)
        self._rp = ctypes.byref(self._remote)

    def _move(self, fn, pid: int, remote: int, local: np.ndarray, what: str) -> None:
        nbytes = local.nbytes
        base = local.__array_interface__["data"][0]
        done = 0
        while done < nbytes:  # the kernel may move less than asked (a partial transfer)
            self._local.base, self._local.len = base + done, nbytes - done
            self._remote.base, self._remote.len = remote + done, nbytes - done
            n = fn(pid, self._lp, 1, self._rp, 1, 0)
            if n <= 0:
                err = ctypes.get_errno()
                raise DDLPeerError(
                    f"cannot {what} local peer pid {pid} ({nbytes} bytes at {remote:#x}): "
                    f"{os.strerror(err) if n < 0 else 'nothing moved'}; did it stop? "
                    "(DDL_SHM_CMA=0 stages private buffers instead)"
                )
            done += n

    def read(self, pid: int, remote: int, out: np.ndarray) -> None:
        """Fill the contiguous ``out`` from ``out.nbytes`` bytes at ``remote`` in ``pid``."""
        self._move(self._readv, pid, remote, out, "read from")

    def write(self, pid: int, remote: int, data: np.ndarray) -> None:
        """Copy the contiguous ``data`` to ``remote`` in ``pid``."""
        self._move(self._writev, pid, remote, data, "write to")

    def probe(self, pid: int, remote: int, expected: int) -> bool:
        """Whether the 8 bytes at ``remote`` in ``pid`` read as ``expected``: the kernel
        allows the read and ``pid`` is the process that published the address (another
        pid namespace would name some other process)."""
        if not remote:
            return False
        got = np.zeros(1, np.int64)
        try:
            self.read(pid, remote, got)
        except DDLPeerError:
            return False
        return int(got[0]) == expected


def load() -> CrossMemory | None:
    """The system's cross-memory calls, or None where libc lacks them (not Linux)."""
    try:
        return CrossMemory()
    except (OSError, AttributeError):
        return None


def probe_value(token: int, local_rank: int) -> int:
    """What local rank ``local_rank``'s probe word holds: derived from the segment's token,
    so a process of another job reads as a mismatch."""
    return (token * 0x9E3779B97F4A7C15 + local_rank + 1) & ((1 << 63) - 1)
