"""Which private buffers the shared-memory engine's peers read and write in place
(cross-memory copies, engines/cma.py) when ``DDL_SHM_CMA`` is ``auto``: those whose pages
are transparent huge pages.

Why the page size decides. ``process_vm_readv`` pins every page it copies. Measured on this
project's 2-core VM (docs/performance.md, session 26): reading 16 MiB of a peer's numpy
array took 0.8-1.0 ms, of a tensor torch allocated 1.9-3.2 ms. numpy advises huge pages for
its arrays of 4 MiB and more and the kernel backs them with 2 MiB pages; torch's allocator
does not, so its tensors sit on 4 KiB pages and every 4 KiB costs a pin. After
``MADV_COLLAPSE`` the same tensor reads in 0.8 ms. Staging through the slots costs the same
on either memory, so cross-memory copies win on huge pages (1.1-1.4x staging at 16-64 MiB
with a barrier between calls; back to back, where staging keeps more in the caches, from
0.8x at 8-16 MiB to 2x at 64 MiB) and lose on small ones (1.3-1.8x slower than staging).

The policy (``HotBuffers``): a buffer whose pages are huge is offered to the peers; one
that is not is staged the first time it is seen, and when the same address and size come
back (a training loop's gradients, a reused output) its pages are collapsed into huge ones
once (``MADV_COLLAPSE``: 2-18 ms for 8-64 MiB here, then free) and offered from then on; a
collapse that fails (pages not all there yet, no memory to compact) is tried on the next
two calls, then the buffer is staged. A buffer whose pages are small again after a collapse
was freed and its address reused by new memory: it is staged from then on, so a program
that allocates afresh every step never pays a collapse per call. Where the kernel cannot
say (``PAGEMAP_SCAN`` needs Linux 6.7) every private buffer is staged, as before; where the
administrator set transparent huge pages to ``never`` nothing is collapsed (the kernel's
collapse would ignore that setting), so only memory already on huge pages is offered.

Each rank decides for its own buffers and says so in its first step's record, so peers
never need to agree on it (shm_chunks.ChunkPlan reads every peer from where it is).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Protocol

_THP = "/sys/kernel/mm/transparent_hugepage"
_MADV_COLLAPSE = 25
_PAGE_IS_HUGE = 1 << 6  # linux/fs.h, the categories of PAGEMAP_SCAN
# errors that say the kernel will never answer (no PAGEMAP_SCAN, no /proc, not allowed);
# any other one (an interrupted call, no descriptor left) fails only the call at hand
_FOR_GOOD = {errno.ENOTTY, errno.EINVAL, errno.ENOENT, errno.EPERM, errno.EACCES,
             errno.ENOSYS}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def huge_page_bytes() -> int:
    """The size of a transparent huge page here (2 MiB with 4 KiB base pages; 512 MiB
    with 64 KiB ones)."""
    text = _read(f"{_THP}/hpage_pmd_size").strip()
    return int(text) if text.isdigit() else 2 << 20


HUGE_BYTES = huge_page_bytes()


class _ScanArg(ctypes.Structure):
    """``struct pm_scan_arg`` (linux/fs.h)."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _Region(ctypes.Structure):
    """``struct page_region``."""

    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("categories", ctypes.c_uint64)]


# _IOWR('f', 16, struct pm_scan_arg)
_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16


def interior(addr: int, nbytes: int) -> tuple[int, int]:
    """The huge-page-aligned range inside ``[addr, addr + nbytes)`` (empty: lo >= hi): the
    pages a collapse may make huge without touching memory outside the buffer."""
    lo = -(-addr // HUGE_BYTES) * HUGE_BYTES
    hi = (addr + nbytes) // HUGE_BYTES * HUGE_BYTES
    return lo, hi


class Pages(Protocol):
    """What HotBuffers asks of the kernel (a fake one in the tests)."""

    def huge(self, addr: int, nbytes: int) -> bool | None: ...

    def collapse(self, addr: int, nbytes: int) -> bool: ...

    def close(self) -> None: ...


class PageSizes:
    """This process's page tables: whether a range is on huge pages, and collapsing it."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._ioctl = libc.ioctl
        self._ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        self._madvise = libc.madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._vec = (_Region * 1)()
        # the huge pages of the range, as one region when they are all of it
        self._arg = _ScanArg(size=ctypes.sizeof(_ScanArg), vec=ctypes.addressof(self._vec),
                             vec_len=1, category_mask=_PAGE_IS_HUGE,
                             return_mask=_PAGE_IS_HUGE)
        self._fd = -1
        self._pid = 0
        self._ident = (0, 0)  # the pagemap file's (device, inode)
        self.scannable = True  # False once the kernel said it never will
        # MADV_COLLAPSE ignores the system's setting: where the administrator chose
        # "never", ddl makes no huge pages either
        self.collapsible = "[never]" not in _read(f"{_THP}/enabled")

    def _pagemap(self) -> int:
        # /proc/self names the process that opened it: a forked child opens its own
        if self._pid != os.getpid():
            fd, self._fd = self._fd, -1
            if fd >= 0 and self._owns(fd):
                os.close(fd)
            self._fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            st = os.fstat(self._fd)
            self._pid, self._ident = os.getpid(), (st.st_dev, st.st_ino)
        return self._fd

    def _owns(self, fd: int) -> bool:
        """Whether ``fd`` is still the pagemap file this object opened (a child may have
        closed it and reused the number)."""
        try:
            st = os.fstat(fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._ident

    def huge(self, addr: int, nbytes: int) -> bool | None:
        """Whether every page of the aligned interior of the range is present and huge
        (None: the kernel cannot say)."""
        lo, hi = interior(addr, nbytes)
        if lo >= hi or not self.scannable:
            return None
        arg, vec = self._arg, self._vec[0]
        arg.start, arg.end, arg.walk_end = lo, hi, 0
        try:
            found = self._ioctl(self._pagemap(), _PAGEMAP_SCAN, ctypes.byref(arg))
            err = ctypes.get_errno() if found < 0 else 0
        except OSError as exc:
            found, err = -1, exc.errno or errno.ENOENT
        if found < 0:  # before Linux 6.7, /proc unreadable, or refused
            if err in _FOR_GOOD:
                self.scannable = False
            return None
        # pages the walk skips (device memory) or lacks are outside the one region
        return found == 1 and vec.start == lo and vec.end == hi

    def collapse(self, addr: int, nbytes: int) -> bool:
        """Make the aligned interior's pages huge now (its data stays); False where the
        kernel would not (no memory to compact, pages not all there, before Linux 6.1) or
        the administrator set transparent huge pages to ``never``."""
        lo, hi = interior(addr, nbytes)
        return self.collapsible and lo < hi and self._madvise(lo, hi - lo, _MADV_COLLAPSE) == 0

    def close(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = -1


_COLLAPSED, _STAGED = -1, -2  # states; 0..TRIES-1: seen, collapses tried so far
TRIES = 3  # a collapse that failed is tried again on the buffer's next calls, this often


class HotBuffers:
    """Whether peers should reach a private buffer in place: the policy of the module
    docstring, one instance per engine (one thread calls it)."""

    def __init__(self, pages: Pages, keep: int = 256) -> None:
        self._pages = pages
        self._keep = keep
        self._state: dict[tuple[int, int], int] = {}
        self.collapses = 0  # buffers made huge
        self.offered = 0  # answers "in place" (both read by the tests and the benchmarks)

    def __call__(self, addr: int, nbytes: int) -> bool:
        huge = self._pages.huge(addr, nbytes)
        if huge is None:
            return False
        if huge:
            self.offered += 1
            return True
        key = (addr, nbytes)
        state = self._state.get(key)
        if state is None:
            if len(self._state) >= self._keep:
                self._state.clear()  # a bounded memory: old buffers are seen afresh
            self._state[key] = 0
            return False
        if state >= 0:
            if self._pages.collapse(addr, nbytes) and self._pages.huge(addr, nbytes):
                self._state[key] = _COLLAPSED
                self.collapses += 1
                self.offered += 1
                return True
            # pages not all there yet, or no memory to compact now: the next call retries
            self._state[key] = state + 1 if state + 1 < TRIES else _STAGED
            return False
        # collapsed once and small again (new memory at the address), or not collapsible
        self._state[key] = _STAGED
        return False

    def close(self) -> None:
        self._pages.close()
