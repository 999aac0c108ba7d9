"""DDP's gradient buckets moved into ddl's shared heap (ddl/torch/shared_buckets.py): which
buffers qualify (pure, one process), and real jobs of 2-4 ranks where DDP on ddl with moved
buckets still equals DDP on gloo, bitwise at 2 ranks."""

import pytest
import torch
from torch_util import reports, run_worker

from ddl.torch.shared_buckets import SharedBuckets


def _in_backward(fn):
    """fn() called inside a backward pass; returns its result."""
    out = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            out.append(fn())
            return grad

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    return out[0]


@pytest.fixture
def sb():
    s = SharedBuckets()
    s.configure(4096)
    return s


def test_a_whole_reused_cpu_buffer_in_backward_qualifies(sb):
    t = torch.empty(1024)
    assert _in_backward(lambda: sb._eligible(t))
    # the first sight only remembers it; the second is the one that moves it
    assert not sb._seen_before(t)
    assert sb._seen_before(t)
    # another storage at the same address (a fresh tensor each step) is a first sight
    u = torch.empty(1024)
    assert not sb._seen_before(u)


@pytest.mark.parametrize("why", ["outside backward", "too small", "part of a storage",
                                 "offset into a storage", "not contiguous", "sparse",
                                 "disabled"])
def test_buffers_that_must_stay_where_they_are(sb, why):
    t = torch.empty(1024)
    if why == "too small":
        t = torch.empty(1023)
    elif why == "part of a storage":
        t = torch.empty(4096)[:1024]
    elif why == "offset into a storage":
        t = torch.empty(2048)[1024:]
    elif why == "not contiguous":
        t = torch.empty(64, 64).t()
    elif why == "sparse":
        t = torch.eye(1024).to_sparse()
    elif why == "disabled":
        sb.configure(0)
    if why == "outside backward":
        assert not sb._eligible(t)
    else:
        assert not _in_backward(lambda: sb._eligible(t))


def test_configure_forgets_what_it_saw(sb):
    t = torch.empty(1024)
    assert not sb._seen_before(t)
    sb.configure(4096)
    assert not sb._seen_before(t)


def test_a_storage_that_died_is_forgotten_even_at_the_same_address(sb):
    t = torch.empty(1024)
    assert not sb._seen_before(t)
    address = t.untyped_storage()._cdata
    del t
    # the remembered weak reference keeps the address from going to another storage
    fresh = [torch.empty(1024) for _ in range(64)]
    assert all(f.untyped_storage()._cdata != address for f in fresh)
    assert not any(sb._seen_before(f) for f in fresh)


@pytest.mark.parametrize("n", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_ddp_with_buckets_in_shared_memory_equals_ddp_on_gloo(n):
    """Both bucket modes, one rank that keeps its buckets private, buffers that must stay,
    a second collective queued behind one in flight on the same tensor, several buffers
    issued back to back (the worker may move one before its collective is planned)."""
    reps = reports(run_worker("ddp_shared_buckets.py", n,
                              env={"DDL_TORCH_SHARE_BYTES": "64K"}))
    for r in reps:
        assert r["failed"] == [], r
        assert r["moved"] > 0


def test_a_buffer_moves_only_while_dev_shm_keeps_a_quarter_free(sb, monkeypatch):
    from ddl.torch import shared_buckets

    t = torch.empty(1 << 20)  # 4 MiB
    sb._seen_before(t)
    monkeypatch.setattr(shared_buckets, "in_shared_memory", lambda arr: False)
    monkeypatch.setattr(shared_buckets, "jobs_in_flight", lambda: 0)
    # 16 MiB of /dev/shm with 6 MiB free: 2 MiB would be left, under a quarter (4 MiB)
    monkeypatch.setattr(shared_buckets.segments, "space", lambda: (16 << 20, 6 << 20))
    monkeypatch.setattr(shared_buckets, "shared_block", lambda n: pytest.fail("moved"))
    assert not _in_backward(lambda: sb.move_if_reused(t))
    monkeypatch.setattr(shared_buckets.segments, "space", lambda: (16 << 20, 9 << 20))
    asked = []  # 5 MiB left, over a quarter: it asks the heap for the block
    monkeypatch.setattr(shared_buckets, "shared_block", lambda n: asked.append(n))
    assert not _in_backward(lambda: sb.move_if_reused(t))
    assert asked == [4 << 20]


def test_nothing_moves_while_queued_work_might_use_it(sb, monkeypatch):
    from ddl.torch import shared_buckets

    t, other = torch.empty(1024), torch.empty(1024)
    sb._seen_before(t)
    monkeypatch.setattr(shared_buckets, "in_shared_memory", lambda arr: False)
    monkeypatch.setattr(shared_buckets, "shared_block", lambda n: pytest.fail("moved"))

    class Handle:
        def add_done_callback(self, fn):
            self.fn = fn

    queued = [1]
    monkeypatch.setattr(shared_buckets, "jobs_in_flight", lambda: queued[0])
    # one job queued that is not this backend's allreduce (a broadcast, a hvd call): no move
    assert not _in_backward(lambda: sb.move_if_reused(t))
    # it is the backend's allreduce of t itself, still in flight: no move
    h = Handle()
    sb.track(t, h)
    assert not _in_backward(lambda: sb.move_if_reused(t))
    h.fn(h)
    # only another storage's allreduce in flight: t may move (it asks for the block)
    sb.track(other, Handle())
    asked = []
    monkeypatch.setattr(shared_buckets, "shared_block", lambda n: asked.append(n))
    assert not _in_backward(lambda: sb.move_if_reused(t))
    assert asked == [4096]
