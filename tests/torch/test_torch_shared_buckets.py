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
    assert not sb._second_sight(t)
    assert sb._second_sight(t)


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
    assert not sb._second_sight(t)
    sb.configure(4096)
    assert not sb._second_sight(t)


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
    sb._second_sight(t)
    # 16 MiB of /dev/shm with 6 MiB free: 2 MiB would be left, under a quarter (4 MiB)
    monkeypatch.setattr(shared_buckets.segments, "space", lambda: (16 << 20, 6 << 20))
    monkeypatch.setattr(shared_buckets, "in_shared_memory", lambda arr: False)
    monkeypatch.setattr(shared_buckets, "shared_block", lambda n: pytest.fail("moved"))
    assert _in_backward(lambda: sb.allreduce_async_(t, None, "x")) is None
    monkeypatch.setattr(shared_buckets.segments, "space", lambda: (16 << 20, 9 << 20))
    asked = []  # 7 MiB left, over a quarter: it asks the heap for the block
    monkeypatch.setattr(shared_buckets, "shared_block", lambda n: asked.append(n))
    sb._second_sight(t)
    assert _in_backward(lambda: sb.allreduce_async_(t, None, "x")) is None
    assert asked == [4 << 20]
