"""The ddl.malloc allocator, in one process."""

import gc

import numpy as np
import pytest

from ddl.engines import segments
from ddl.engines.heap import Heap, decode


@pytest.fixture
def heap():
    h = Heap("heaptest", 0, 0, 1 << 20)
    yield h
    h.close()
    assert segments.list_job("heaptest") == []


def _span(a):
    p = a.__array_interface__["data"][0]
    return p, p + a.nbytes


def test_live_arrays_never_overlap(heap):
    arrays = [heap.malloc((1000 + i,), np.float32) for i in range(50)]
    spans = sorted(_span(a) for a in arrays)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for i, a in enumerate(arrays):
        a[:] = i
    assert all((a == i).all() for i, a in enumerate(arrays))


def test_a_view_keeps_its_block(heap):
    view = heap.malloc((4096,), np.float64)[10:20]
    gc.collect()
    other = heap.malloc((4096,), np.float64)
    lo, hi = _span(view)
    olo, ohi = _span(other)
    assert hi <= olo or ohi <= lo


def test_freed_blocks_are_reused_and_coalesced(heap):
    a = heap.malloc((100_000,), np.uint8)
    b = heap.malloc((100_000,), np.uint8)
    pa = _span(a)[0]
    del a, b
    gc.collect()
    c = heap.malloc((200_000,), np.uint8)  # fits only if the two blocks merged
    assert _span(c)[0] == pa
    assert len(heap._segs) == 1


def test_large_requests_get_their_own_segment(heap):
    small = heap.malloc((10,), np.uint8)
    big = heap.malloc((3 << 20,), np.uint8)
    assert heap.locate(small) != 0
    assert big.size == 3 << 20
    assert len(heap._segs) == 2
    seg, off = decode(heap.locate(big))
    assert seg == 1 and off == 0


def test_locate_only_knows_heap_memory(heap):
    a = heap.malloc((64,), np.int32)
    assert heap.locate(a) != 0
    assert heap.locate(a[8:]) == heap.locate(a) + 32
    assert heap.locate(np.zeros(64, np.int32)) == 0


def test_exact_requests_reserve_only_what_they_take_and_reuse_room(heap):
    import mmap

    a = heap.malloc((5000,), np.uint8, exact=True)  # no segment yet: one sized to it
    assert [s.size for s in heap._segs] == [mmap.PAGESIZE * 2]
    small = heap.malloc((1000,), np.uint8, exact=True)  # room left in it: no new segment
    assert len(heap._segs) == 1 and heap.locate(small) != 0
    del a, small
    gc.collect()
    b = heap.malloc((8000,), np.uint8, exact=True)  # the freed room, coalesced, fits it
    assert len(heap._segs) == 1 and decode(heap.locate(b)) == (0, 0)
    heap.malloc((100,), np.uint8)  # an ordinary request without room: a full segment
    assert heap._segs[-1].size == 1 << 20


def test_blocks_freed_on_other_threads_never_overlap_live_ones(heap):
    import random
    import threading

    live, lock = [], threading.Lock()

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        for _ in range(300):
            a = heap.malloc((rng.randrange(1, 20_000),), np.uint8)
            a[:] = seed
            mine.append(a)
            if rng.random() < 0.6:
                mine.pop(rng.randrange(len(mine)))  # freed here, on this thread
        with lock:
            live.extend((seed, a) for a in mine)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = sorted(_span(a) for _, a in live)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all((a == seed).all() for seed, a in live)
