"""Ring and halving-doubling against numpy, over an in-process fake group, every size."""

import threading

import numpy as np
import pytest

from ddl import cost
from ddl.algorithms import ring
from ddl.algorithms.dims import split
from ddl.dtypes import BY_NAME
from ddl.ops import Sum


class Net:
    """n in-process ranks exchanging bytes through mailboxes."""

    def __init__(self, n):
        self.n = n
        self.box = {}
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
                    net.cv.notify_all()
                    net.cv.wait_for(lambda: (frm, r, k) in net.box, timeout=10)
                    recv[...] = net.box.pop((frm, r, k)).view(recv.dtype).reshape(recv.shape)

        return G()


def _run(n, count, alg):
    net = Net(n)
    rng = np.random.default_rng(count)
    inputs = [rng.integers(-50, 50, count).astype(np.int64) for _ in range(n)]
    bufs = [x.copy() for x in inputs]
    counts = split(count, n)
    dt = BY_NAME["int64"]

    def rank(r):
        g = net.group(r)
        if alg == "ring":
            ring.ring_reduce_scatter(g, bufs[r], counts, dt, Sum)
            ring.ring_allgather(g, bufs[r], counts)
        else:
            ring.hd_reduce_scatter(g, bufs[r], counts, dt, Sum)
            ring.hd_allgather(g, bufs[r], counts)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    want = sum(inputs)
    for b in bufs:
        assert np.array_equal(b, want)


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
