"""``ddl.malloc``: arrays that live in shared memory, so peers read and write them in place.

Each rank owns heap segments (``ddl-<job>-h<host>-heap<local rank>-<k>``, keyed like every
segment name when the job has a secret) carved by a first-fit free list; an array returns
its block when it is garbage collected. A collective whose buffers live here skips the copy
into the staging area (IBM's pyddl.malloc did the same for fusion buffers). Peers map a
heap segment the first time an operation names it, so its name stays until shutdown.

A segment's first page is its header (``_MAGIC``, and the job's token where every segment
has it, ``segments.TOKEN_OFFSET``); the blocks, and the offsets peers are told, start after
it.
"""

from __future__ import annotations

import bisect
import collections
import mmap
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from ..config import HEAP_MIN
from ..errors import DDLShmError
from . import segments

_ALIGN = 256  # cache-line and AVX friendly; keeps every dtype aligned
_HEADER = mmap.PAGESIZE  # bytes before a segment's blocks
_MAGIC = int.from_bytes(b"DDL_HEAP", "little")
_OFF_BITS = 40  # location code = 1 + (segment << 40) + offset


@dataclass
class _Segment:
    name: str
    mm: mmap.mmap
    u8: np.ndarray
    base: int
    size: int
    free: list[tuple[int, int]] = field(default_factory=list)  # sorted (offset, size)


def _base(u8: np.ndarray) -> int:
    return u8.__array_interface__["data"][0]


def encode(seg: int, offset: int) -> int:
    return 1 + (seg << _OFF_BITS) + offset


def decode(loc: int) -> tuple[int, int]:
    v = loc - 1
    return v >> _OFF_BITS, v & ((1 << _OFF_BITS) - 1)


class Heap:
    """This rank's shared heap."""

    def __init__(self, job_id: str, host_index: int, local_rank: int, segment_bytes: int,
                 scope: str = "", *, secret: bytes | None = None, token: int | None = None):
        """``secret``: the job's (keys the names); ``token``: the job's mark, by default
        ``segments.segment_token(job_id, secret)``."""
        self._job = job_id
        self._scope = scope
        self._host = host_index
        self._lr = local_rank
        self._secret = secret
        self._token = segments.segment_token(job_id, secret) if token is None else token
        self._segment_bytes = max(segment_bytes, HEAP_MIN)
        self._segs: list[_Segment] = []
        # A block comes back on whichever thread drops its last array (ddl's worker too,
        # or the garbage collector in the middle of a malloc): it is only queued there, and
        # malloc files the queue into the free lists under the lock.
        self._lock = threading.Lock()
        self._returned: collections.deque[tuple[int, int, int]] = collections.deque()

    def _new_segment(self, at_least: int, exact: bool = False) -> int:
        k = len(self._segs)
        size = -(-at_least // mmap.PAGESIZE) * mmap.PAGESIZE
        if not exact:
            size = max(self._segment_bytes, size)
        name = segments.segment_name(self._job, self._host, f"{self._scope}heap{self._lr}-{k}",
                                     self._secret)
        mm = segments.create(name, _HEADER + size, self._token)
        mm[:8] = _MAGIC.to_bytes(8, "little")
        u8 = np.frombuffer(mm, dtype=np.uint8, offset=_HEADER)
        self._segs.append(_Segment(name, mm, u8, _base(u8), size, [(0, size)]))
        return k

    def malloc(self, shape, dtype, exact: bool = False) -> np.ndarray:
        """``exact``: where no segment has room, the new one is sized to the array (rounded
        to pages), not to DDL_SHM_HEAP_BYTES, so no more of /dev/shm is reserved than it
        takes (long-lived buffers moved here: DDP's buckets)."""
        dt = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        need = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            while self._returned:
                self._file_free(*self._returned.popleft())
            k, off = self._place(need, exact)
        seg = self._segs[k]
        # An array made straight from the mapping (not a view of seg.u8): numpy collapses
        # view bases, so only an array whose base is the mmap itself is kept alive by every
        # view the caller takes; its finalizer gives the block back.
        block = np.frombuffer(seg.mm, dtype=np.uint8, count=need, offset=_HEADER + off)
        weakref.finalize(block, self._give_back, k, off, need)
        return block[:nbytes].view(dt).reshape(shape)

    def _place(self, need: int, exact: bool = False) -> tuple[int, int]:
        for k, seg in enumerate(self._segs):
            off = self._take(seg, need)
            if off is not None:
                return k, off
        k = self._new_segment(need, exact)
        off = self._take(self._segs[k], need)
        if off is None:  # pragma: no cover - a fresh segment always fits
            raise DDLShmError(f"ddl.malloc could not place {need} bytes")
        return k, off

    @staticmethod
    def _take(seg: _Segment, need: int) -> int | None:
        for i, (off, size) in enumerate(seg.free):
            if size >= need:
                if size == need:
                    del seg.free[i]
                else:
                    seg.free[i] = (off + need, size - need)
                return off
        return None

    def _give_back(self, k: int, off: int, size: int) -> None:
        self._returned.append((k, off, size))  # atomic: no lock, so no re-entrance

    def _file_free(self, k: int, off: int, size: int) -> None:
        if k >= len(self._segs):
            return
        free = self._segs[k].free
        i = bisect.bisect(free, (off, size))
        free.insert(i, (off, size))
        # Coalesce with the neighbours so large blocks come back.
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i] = (off, free[i][1] + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    def locate(self, arr: np.ndarray) -> int:
        """The location code of a contiguous array inside this heap, or 0."""
        if not self._segs or arr.size == 0:
            return 0
        ptr = arr.__array_interface__["data"][0]
        end = ptr + arr.nbytes
        for k, seg in enumerate(self._segs):
            if seg.base <= ptr and end <= seg.base + seg.size:
                return encode(k, ptr - seg.base)
        return 0

    def close(self) -> None:
        for seg in self._segs:
            segments.unlink(seg.name)
        self._segs = []  # mappings go away with the last array that uses them


class PeerHeaps:
    """Read-write views into the heaps of the other ranks on this host."""

    def __init__(self, job_id: str, host_index: int, scope: str = "", *,
                 secret: bytes | None = None, token: int | None = None):
        self._job = job_id
        self._scope = scope
        self._host = host_index
        self._secret = secret
        self._token = segments.segment_token(job_id, secret) if token is None else token
        self._maps: dict[tuple[int, int], np.ndarray] = {}

    def view(self, local_rank: int, loc: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        seg, off = decode(loc)
        key = (local_rank, seg)
        u8 = self._maps.get(key)
        if u8 is None:
            name = segments.segment_name(self._job, self._host,
                                         f"{self._scope}heap{local_rank}-{seg}", self._secret)
            try:
                mm = segments.open_existing(name)
            except FileNotFoundError:
                raise DDLShmError(
                    f"heap segment {name} of local rank {local_rank} is gone "
                    "(was its owner shut down?)"
                ) from None
            if not segments.carries(mm, self._token):
                mm.close()
                raise DDLShmError(
                    f"heap segment {segments.SHM_DIR}/{name} of local rank {local_rank} does "
                    f"not carry this job's token: two jobs share job id {self._job!r}; give "
                    "each its own DDL_JOB_ID (ddlrun does)"
                )
            u8 = np.frombuffer(mm, dtype=np.uint8, offset=_HEADER)
            self._maps[key] = u8
        return u8[off : off + nbytes].view(dtype)

    def close(self) -> None:
        self._maps.clear()
