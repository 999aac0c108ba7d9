"""Ring and halving-doubling against numpy, over an in-process fake group, every size."""

import threading
import time

import numpy as np
import pytest

from ddl import cost
from ddl.algorithms import ring
from ddl.dtypes import BY_NAME
from ddl.grid import even_split
from ddl.ops import Sum


class Net:
    """n in-process ranks exchanging bytes through mailboxes."""

    def __init__(self, n):
        self.n = n
        self.box = {}
        self.sent = 0  # bytes, all ranks together
        self.cv = threading.Condition()

    def group(self, r):
        net = self

        class G:
            size, rank = net.n, r
            seq = {}

            def sendrecv(self, send, to, recv, frm):
                k = G.seq[(r, to, frm)] = G.seq.get((r, to, frm), 0) + 1
                with net.cv:
                    net.box[(r, to, k)] = send.copy()
                    net.sent += send.nbytes
                    net.cv.notify_all()
                    net.cv.wait_for(lambda: (frm, r, k) in net.box, timeout=10)
                    recv[...] = net.box.pop((frm, r, k)).view(recv.dtype).reshape(recv.shape)

        return G()


def _run(n, count, alg):
    net = Net(n)
    rng = np.random.default_rng(count)
    inputs = [rng.integers(-50, 50, count).astype(np.int64) for _ in range(n)]
    bufs = [x.copy() for x in inputs]
    counts = even_split(count, n)
    dt = BY_NAME["int64"]
    errors = {}

    def rank(r):
        try:
            g = net.group(r)
            if alg == "ring":
                ring.ring_reduce_scatter(g, bufs[r], counts, dt, Sum)
                ring.ring_allgather(g, bufs[r], counts)
            else:
                ring.hd_reduce_scatter(g, bufs[r], counts, dt, Sum)
                ring.hd_allgather(g, bufs[r], counts)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors[r] = exc

    ts = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 30
    for t in ts:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(ts) if t.is_alive()]
    assert not stuck, f"ranks {stuck} still running after 30s (a send nobody received?)"
    assert not errors, f"ranks raised: {errors!r}"
    assert net.box == {}, f"messages sent but never received: {sorted(net.box)}"
    # bandwidth-optimal: every element crosses n-1 links in each half (and none for count=0)
    assert net.sent == 2 * (n - 1) * count * 8, net.sent
    want = sum(inputs)
    for r, b in enumerate(bufs):
        assert b.dtype == np.int64 and b.shape == (count,), (r, b.dtype, b.shape)
        assert np.array_equal(b, want), r


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("count", [0, 1, 7, 1001])
def test_ring(n, count):
    _run(n, count, "ring")


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("count", [0, 3, 1001])
def test_halving_doubling(n, count):
    _run(n, count, "hd")


def test_cost_model_prefers_latency_optimal_for_small_messages():
    link = cost.NETWORK
    assert cost.best(["ring", "hd"], 8, 1024, link) == "hd"
    assert cost.allreduce_time("hd", 6, 1024, link) == float("inf")
    # bandwidth terms are equal: big messages tie, and ring is never worse
    assert cost.allreduce_time("ring", 8, 1 << 30, link) >= cost.allreduce_time(
        "hd", 8, 1 << 30, link)
    assert cost.best(["ring", "hd"], 6, 1 << 20, link) == "ring"


def test_cost_model_multidim_moves_fewer_bytes_across_hosts():
    shm, net = cost.SHARED_MEMORY, cost.NETWORK
    flat = cost.allreduce_time("ring", 4, 64 << 20, net)
    hier = cost.multidim_time([("shm", 2, shm), ("ring", 2, net)], 64 << 20)
    assert hier < flat
    assert cost.pipelined_time([("shm", 2, shm), ("ring", 2, net)], 64 << 20, 16) < hier


def test_simulate_prints_a_prediction_per_size(capsys):
    from ddl.perf.cli import main

    assert main(["simulate", "--grid", "4x8", "--sizes", "1M,64M"]) == 0
    out = capsys.readouterr().out
    assert "grid 4x8 = 32 ranks" in out and len(out.strip().splitlines()) == 4


def test_cost_model_prefers_the_engines_pipelined_collective_when_steps_tie():
    # 2 ranks: ring, hd and native take the same steps; native hides its reduction
    assert cost.best(["ring", "native", "hd"], 2, 64 << 20, cost.NETWORK) == "native"
    # many ranks, tiny message: halving-doubling's log2(n) steps win
    assert cost.best(["ring", "native", "hd"], 64, 1024, cost.NETWORK) == "hd"


def test_chunk_sizes_ramp_down_at_both_ends_of_the_pipeline():
    from ddl.algorithms.multidim import chunk_sizes

    m = 1 << 20
    assert chunk_sizes(16 * m, 4 * m) == [m // 2, m, 2 * m, 3 * m, 3 * m, 3 * m, 2 * m, m, m // 2]
    assert chunk_sizes(4 * m, 4 * m) == [4 * m]  # one chunk: nothing to pipeline
    assert chunk_sizes(0, 4 * m) == [0]
    for n in (1, 5, 4 * m + 1, 6 * m, 10 * m + 3, 64 * m, 1000):
        sizes = chunk_sizes(n, 4 * m if n > 1000 else 64)
        assert sum(sizes) == n and all(s > 0 for s in sizes)
        mid = sizes[len(sizes) // 2]
        assert sizes[0] <= mid + 1 and sizes[-1] <= mid + 1


def test_chunk_plan_follows_each_dimensions_block():
    from ddl.algorithms.multidim import chunk_plan

    class Dim:
        def __init__(self, size, rank):
            self.size, self.rank = size, rank

    plan = chunk_plan(100, [Dim(2, 1), Dim(3, 2)], 16)
    covered = []
    for segs in plan:
        (a0, b0, c0), (a1, b1, c1) = segs
        assert sum(c0) == b0 - a0 and sum(c1) == b1 - a1
        assert (a1, b1) == (a0 + c0[0], a0 + c0[0] + c0[1])  # rank 1's block of dim 0
        covered.append((a0, b0))
    assert covered[0][0] == 0 and covered[-1][1] == 100
    assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
