"""Which private buffers the shared-memory engine's peers reach in place under
DDL_SHM_CMA=auto (engines/hugepages.py): the policy against a fake kernel, and the kernel's
own answers where this machine gives them."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform

import numpy as np
import pytest

from ddl.engines import hugepages
from ddl.engines.hugepages import HUGE_BYTES, TRIES, HotBuffers, PageSizes, interior


class FakePages:
    """Page tables in a dict: address -> huge; collapse makes a range huge unless refused."""

    def __init__(self, scannable: bool = True, collapsible: bool = True) -> None:
        self.is_huge: dict[int, bool] = {}
        self.scannable, self.collapsible = scannable, collapsible
        self.collapsed: list[int] = []

    def huge(self, addr: int, nbytes: int) -> bool | None:
        return self.is_huge.get(addr, False) if self.scannable else None

    def collapse(self, addr: int, nbytes: int) -> bool:
        self.collapsed.append(addr)
        if self.collapsible:
            self.is_huge[addr] = True
        return self.collapsible

    def close(self) -> None:
        pass


MIB16 = 16 << 20


def test_a_buffer_on_huge_pages_is_offered_at_once():
    pages = FakePages()
    pages.is_huge[0x1000] = True
    reach = HotBuffers(pages)
    assert [reach(0x1000, MIB16) for _ in range(3)] == [True, True, True]
    assert pages.collapsed == [] and reach.collapses == 0


def test_a_reused_buffer_is_collapsed_once_then_offered():
    pages = FakePages()
    reach = HotBuffers(pages)
    assert reach(0x1000, MIB16) is False  # first seen: staged, nothing spent on it
    assert pages.collapsed == []
    assert reach(0x1000, MIB16) is True  # back again: made huge
    assert [reach(0x1000, MIB16) for _ in range(5)] == [True] * 5
    assert pages.collapsed == [0x1000] and reach.collapses == 1


def test_the_same_address_with_another_size_is_another_buffer():
    pages = FakePages()
    reach = HotBuffers(pages)
    assert reach(0x1000, MIB16) is False
    assert reach(0x1000, 2 * MIB16) is False
    assert pages.collapsed == []


def test_new_memory_at_a_collapsed_address_is_staged_without_another_collapse():
    """A program that allocates afresh every step, at an address the allocator reuses,
    pays one collapse, never one per call."""
    pages = FakePages()
    reach = HotBuffers(pages)
    reach(0x1000, MIB16)
    assert reach(0x1000, MIB16) is True
    pages.is_huge[0x1000] = False  # freed; new small pages at the same address
    assert [reach(0x1000, MIB16) for _ in range(4)] == [False] * 4
    assert pages.collapsed == [0x1000]
    pages.is_huge[0x1000] = True  # huge pages there again (numpy's memory): offered
    assert reach(0x1000, MIB16) is True


def test_a_refused_collapse_is_retried_twice_then_the_buffer_is_staged():
    pages = FakePages(collapsible=False)
    reach = HotBuffers(pages)
    assert [reach(0x1000, MIB16) for _ in range(6)] == [False] * 6
    assert pages.collapsed == [0x1000] * TRIES


def test_a_collapse_that_fails_once_succeeds_on_the_next_call():
    """The first try may find the pages not all there (an output the first call filled)."""
    pages = FakePages(collapsible=False)
    reach = HotBuffers(pages)
    assert reach(0x1000, MIB16) is False
    assert reach(0x1000, MIB16) is False
    pages.collapsible = True
    assert reach(0x1000, MIB16) is True
    assert pages.collapsed == [0x1000, 0x1000] and reach.collapses == 1


def test_a_kernel_that_cannot_tell_stages_everything():
    pages = FakePages(scannable=False)
    reach = HotBuffers(pages)
    assert [reach(0x1000, MIB16) for _ in range(3)] == [False] * 3
    assert pages.collapsed == []


def test_the_memory_of_buffers_seen_is_bounded():
    pages = FakePages()
    reach = HotBuffers(pages, keep=4)
    for a in range(10):
        reach(0x1000 * (a + 1), MIB16)
    assert len(reach._state) <= 4


def test_interior_stays_inside_the_buffer():
    lo, hi = interior(HUGE_BYTES + 16, 3 * HUGE_BYTES)
    assert (lo, hi) == (2 * HUGE_BYTES, 4 * HUGE_BYTES)
    lo, hi = interior(16, HUGE_BYTES)
    assert lo >= hi  # no whole huge page inside


def test_the_scan_arguments_match_the_kernel_header():
    """``struct pm_scan_arg`` is twelve u64 (96 bytes) and PAGEMAP_SCAN is
    _IOWR('f', 16, struct pm_scan_arg); a wrong one would read as "cannot tell" and stage
    everything without a word."""
    assert ctypes.sizeof(hugepages._ScanArg) == 96
    assert hugepages._PAGEMAP_SCAN == 0xC0606610
    assert hugepages._PAGE_IS_HUGE == 1 << 6


def _linux_at_least(major: int, minor: int) -> bool:
    try:
        got = tuple(int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


def _kernel() -> PageSizes:
    pages = PageSizes()
    probe = np.ones(4 * HUGE_BYTES // 8)
    if pages.huge(probe.ctypes.data, probe.nbytes) is None:
        # a kernel that has PAGEMAP_SCAN must answer: a wrong ioctl would hide here
        assert not (_linux_at_least(6, 7) and os.path.exists("/proc/self/pagemap")), (
            "Linux >= 6.7 has PAGEMAP_SCAN, yet the scan did not answer")
        pytest.skip("this kernel has no PAGEMAP_SCAN (Linux 6.7) or /proc/self/pagemap")
    return pages


def _madvise(addr: int, nbytes: int, advice: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(addr, nbytes, advice)


def test_the_kernel_reports_small_pages_and_collapses_them():
    """An anonymous mapping touched page by page while advised against huge pages sits on
    4 KiB pages (whatever the system's THP mode); MADV_COLLAPSE makes its interior huge and
    keeps the data; a hole of one page makes its huge page's range small again."""
    pages = _kernel()
    mm = mmap.mmap(-1, 8 * HUGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(mm, np.uint8)
    collapsed = False
    try:
        addr = arr.ctypes.data
        assert _madvise(addr, arr.nbytes, mmap.MADV_NOHUGEPAGE) == 0
        arr[::4096] = 7  # every page present, each a small one
        arr[12345] = 3
        assert pages.huge(addr, arr.nbytes) is False
        assert _madvise(addr, arr.nbytes, mmap.MADV_HUGEPAGE) == 0  # lifts NOHUGEPAGE
        collapsed = pages.collapse(addr, arr.nbytes)
        if collapsed:
            assert pages.huge(addr, arr.nbytes) is True
            assert arr[12345] == 3 and arr[4096] == 7
            assert int(arr.sum(dtype=np.int64)) == 7 * (arr.nbytes // 4096) + 3
            lo, _ = interior(addr, arr.nbytes)
            assert _madvise(lo + 4096, 4096, mmap.MADV_DONTNEED) == 0  # a hole
            assert pages.huge(addr, arr.nbytes) is False
    finally:
        del arr
        mm.close()
        pages.close()
    if not collapsed:
        pytest.skip("the kernel refused MADV_COLLAPSE (THP never, or no memory to compact)")


def test_a_forked_child_scans_its_own_page_tables():
    """The child opens its own /proc/self/pagemap (the parent's would answer for the
    parent's memory): memory only the child touched reads as the child's."""
    pages = _kernel()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            mine = np.ones(4 * HUGE_BYTES // 8)  # numpy advises huge pages from 4 MiB
            answer = pages.huge(mine.ctypes.data, mine.nbytes)
            code = 0 if pages._pid == os.getpid() and answer is not None else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    pages.close()
