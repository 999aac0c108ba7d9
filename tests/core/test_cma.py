"""Cross-memory attach in the shared-memory engine: peers read and write a rank's private
buffers in place. Three local ranks as three threads of this process (the kernel always
lets a process read itself, so the probe passes here; tests/core/test_collectives.py checks
the choice across real processes), mixing every kind of buffer a rank may bring: private,
heap, pieces of a fusion, strided (staged) ones."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import ddl
from ddl import dtypes
from ddl.engines import cma
from ddl.engines.shm import ShmEngine
from ddl.errors import DDLPeerError
from ddl.tensors import Pieces

F32 = dtypes.BY_NAME["float32"]
N = 3
COUNT = 2_100_001  # float32: over cma.MIN_BYTES, and not divisible by 3


def _engines(tag: str, cma_on=(True, True, True)) -> list[ShmEngine]:
    job = f"cma{os.getpid()}{tag}"
    engines: list[ShmEngine | None] = [None] * N

    def make(rank: int) -> None:
        engines[rank] = ShmEngine(job_id=job, host_index=0, local_rank=rank, local_size=N,
                                  global_rank=rank, heap_bytes=32 << 20, token=7, timeout=20.0,
                                  slot_bytes=64 << 10, max_bytes=1 << 20, cma=cma_on[rank])

    _all([lambda r=r: make(r) for r in range(N)])
    assert all(e is not None for e in engines), "the engines did not attach"
    return engines


def _all(steps: list) -> list:
    """Run every rank's step at once; each one's result (an error is raised here)."""
    out: list = [None] * len(steps)

    def run(rank: int) -> None:
        try:
            out[rank] = steps[rank]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def _inputs() -> list[np.ndarray]:
    return [np.arange(COUNT, dtype=np.float32) % 97 * (r + 1) for r in range(N)]


def _close(engines) -> None:
    _all([e.close for e in engines])


@pytest.fixture
def three():
    engines = _engines("a")
    yield engines
    _close(engines)


def test_every_rank_agrees_to_use_it(three):
    assert [e.cross_memory for e in three] == [True] * N
    assert COUNT * 4 >= cma.MIN_BYTES


def test_buffers_are_read_where_they_live(three, monkeypatch):
    """The peers' inputs are read by cross-memory copies, not from their slots: no rank
    stages anything (a staging call would fail here)."""
    for e in three:
        monkeypatch.setattr(e, "_stage_inputs", None)
    xs = _inputs()
    want = sum(xs)
    _all([lambda r=r: three[r].allreduce(xs[r], xs[r], F32, ddl.Sum, (COUNT,))
          for r in range(N)])
    assert all(np.array_equal(x, want) for x in xs)


def test_private_buffers_out_of_place_and_in_place(three):
    xs = _inputs()
    keep = [x.copy() for x in xs]
    want = sum(keep)
    outs = [np.empty(COUNT, np.float32) for _ in range(N)]
    _all([lambda r=r: three[r].allreduce(xs[r], outs[r], F32, ddl.Sum, (COUNT,))
          for r in range(N)])
    for r in range(N):
        assert np.array_equal(outs[r], want), r
        assert np.array_equal(xs[r], keep[r]), "the input changed"
    _all([lambda r=r: three[r].allreduce(xs[r], xs[r], F32, ddl.Max, (COUNT,))
          for r in range(N)])
    for r in range(N):
        assert np.array_equal(xs[r], keep[N - 1]), r


def test_heap_pieces_and_private_buffers_mix(three):
    """Rank 0 brings heap memory, rank 1 the pieces of a fusion (staged), rank 2 private
    memory; every rank's output is private except rank 0's, in its heap."""
    xs = _inputs()
    want = sum(xs)
    heap_in = three[0].heap.malloc((COUNT,), np.float32)
    heap_in[:] = xs[0]
    cut = 123_457
    srcs = [heap_in, Pieces([xs[1][:cut].copy(), xs[1][cut:].copy()]), xs[2]]
    outs = [three[0].heap.malloc((COUNT,), np.float32), np.empty(COUNT, np.float32),
            np.empty(COUNT, np.float32)]
    _all([lambda r=r: three[r].allreduce(srcs[r], outs[r], F32, ddl.Sum, (COUNT,))
          for r in range(N)])
    for r in range(N):
        assert np.array_equal(outs[r], want), r


def test_reduce_scatter_with_a_staged_strided_input(three):
    """Rank 1's input is strided (staged through its slot), the others' are read in place:
    every rank takes the same steps, and each part is right."""
    xs = _inputs()
    wide = np.zeros(2 * COUNT, np.float32)
    wide[::2] = xs[1]
    srcs = [xs[0], wide[::2], xs[2]]
    counts = [700_000, 1_050_001, 350_000]
    starts = [0, 700_000, 1_750_001]
    want = sum(xs)
    outs = [np.empty(c, np.float32) for c in counts]
    for _ in range(2):  # twice: the steps after the first call must line up too
        _all([lambda r=r: three[r].reduce_scatter(srcs[r], outs[r], F32, ddl.Sum, (COUNT,),
                                                  counts) for r in range(N)])
        for r in range(N):
            assert np.array_equal(outs[r], want[starts[r] : starts[r] + counts[r]]), r


def test_one_rank_refusing_makes_every_rank_stage():
    engines = _engines("b", cma_on=(True, False, True))
    try:
        assert [e.cross_memory for e in engines] == [False] * N
        xs = _inputs()
        want = sum(xs)
        _all([lambda r=r: engines[r].allreduce(xs[r], xs[r], F32, ddl.Sum, (COUNT,))
              for r in range(N)])
        assert all(np.array_equal(x, want) for x in xs)
    finally:
        _close(engines)


def test_a_gone_peer_is_an_error_naming_it():
    xmem = cma.load()
    assert xmem is not None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child exits at once
        os._exit(0)
    os.waitpid(pid, 0)
    here = np.zeros(4, np.int64)
    with pytest.raises(DDLPeerError, match=f"pid {pid}"):
        xmem.read(pid, here.__array_interface__["data"][0], np.zeros(4, np.int64))
    assert not xmem.probe(pid, here.__array_interface__["data"][0], 0)


def test_the_probe_reads_only_the_expected_word():
    xmem = cma.load()
    word = np.array([cma.probe_value(11, 2)], np.int64)
    addr = word.__array_interface__["data"][0]
    assert xmem.probe(os.getpid(), addr, cma.probe_value(11, 2))
    assert not xmem.probe(os.getpid(), addr, cma.probe_value(11, 1))  # another rank's value
    assert not xmem.probe(os.getpid(), addr, cma.probe_value(12, 2))  # another job's
    assert not xmem.probe(os.getpid(), 0, cma.probe_value(11, 2))  # nothing published


# ------------------------------------------------- DDL_SHM_CMA=auto: verdicts per rank
class _Verdicts:
    """A rank's policy answering from a table (address -> in place?), counting its calls."""

    def __init__(self) -> None:
        self.table: dict[int, bool] = {}
        self.calls: list[int] = []

    def __call__(self, addr: int, nbytes: int) -> bool:
        self.calls.append(addr)
        return self.table.get(addr, False)

    def close(self) -> None:
        pass


class _CountingMemory:
    """The engine's cross-memory copies, recording every remote address read or written."""

    def __init__(self, inner) -> None:
        self.inner, self.reads, self.writes = inner, [], []

    def read(self, pid, remote, out):
        self.reads.append(remote)
        self.inner.read(pid, remote, out)

    def write(self, pid, remote, data):
        self.writes.append(remote)
        self.inner.write(pid, remote, data)


def _within(addrs: list[int], arr: np.ndarray) -> int:
    lo = arr.__array_interface__["data"][0]
    return sum(lo <= a < lo + arr.nbytes for a in addrs)


@pytest.fixture
def three_auto():
    engines = _engines("auto", cma_on=("auto",) * N)
    assert all(e.cross_memory and e.hot_buffers is not None for e in engines)
    for e in engines:
        e._reach = _Verdicts()
        e._xmem = _CountingMemory(e._xmem)
    yield engines
    _close(engines)


def test_auto_reads_in_place_only_the_buffers_their_owners_offer(three_auto):
    """Rank 0 offers its buffer, rank 1 does not (staged), rank 2 from its second call on:
    the peers read rank 0's memory (and rank 2's once offered) and never rank 1's, every
    result is right, and an in-place call asks the policy once per rank."""
    xs = _inputs()
    want = sum(xs)
    three_auto[0]._reach.table[xs[0].ctypes.data] = True
    for call in range(2):
        if call == 1:  # the same buffers again, their inputs again; rank 2 offers now
            three_auto[2]._reach.table[xs[2].ctypes.data] = True
            for r, fresh in enumerate(_inputs()):
                xs[r][:] = fresh
        _all([lambda r=r: three_auto[r].allreduce(xs[r], xs[r], F32, ddl.Sum, (COUNT,))
              for r in range(N)])
        assert all(np.array_equal(x, want) for x in xs), call
    reads = [a for e in three_auto for a in e._xmem.reads]
    writes = [a for e in three_auto for a in e._xmem.writes]
    assert _within(reads, xs[0]) > 0 and _within(writes, xs[0]) > 0
    assert _within(reads, xs[1]) == 0 and _within(writes, xs[1]) == 0
    assert _within(reads, xs[2]) > 0  # the second call only
    assert [len(e._reach.calls) for e in three_auto] == [2, 2, 2]


def test_auto_out_of_place_asks_for_input_and_output(three_auto):
    xs = _inputs()
    want = sum(xs)
    outs = [np.empty(COUNT, np.float32) for _ in range(N)]
    three_auto[1]._reach.table[outs[1].ctypes.data] = True  # only rank 1's output offered
    _all([lambda r=r: three_auto[r].allreduce(xs[r], outs[r], F32, ddl.Sum, (COUNT,))
          for r in range(N)])
    assert all(np.array_equal(o, want) for o in outs)
    writes = [a for e in three_auto for a in e._xmem.writes]
    assert _within(writes, outs[1]) > 0 and _within(writes, outs[0]) == 0
    assert [len(e._reach.calls) for e in three_auto] == [2, 2, 2]


def test_auto_reduce_scatter_with_mixed_verdicts(three_auto):
    xs = _inputs()
    want = sum(xs)
    counts = [700_000, 1_050_001, 350_000]
    starts = [0, 700_000, 1_750_001]
    three_auto[1]._reach.table[xs[1].ctypes.data] = True
    outs = [np.empty(c, np.float32) for c in counts]
    for _ in range(2):
        _all([lambda r=r: three_auto[r].reduce_scatter(xs[r], outs[r], F32, ddl.Sum,
                                                       (COUNT,), counts) for r in range(N)])
        for r in range(N):
            assert np.array_equal(outs[r], want[starts[r] : starts[r] + counts[r]]), r
    reads = [a for e in three_auto for a in e._xmem.reads]
    assert _within(reads, xs[1]) > 0 and _within(reads, xs[0]) == 0
