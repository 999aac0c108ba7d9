"""DDP's buckets in ddl's shared heap (ddl/torch/shared_buckets.py): DDP on ddl, with its
buckets moved, still equals DDP on gloo in both bucket modes, with and without every rank
moving them; buffers that must stay where they are stay; a tensor with collectives in
flight never moves under them.

Run with a small DDL_TORCH_SHARE_BYTES (the test sets 64 KiB) so these small models move.
"""

import copy
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddl
import ddl.torch  # noqa: F401 - registers the "ddl" backend
from ddl.api import in_shared_memory, jobs_in_flight
from ddl.torch import backend

torch.set_num_threads(1)
dist.init_process_group("ddl", init_method="env://")
R, N = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
shared = backend._shared
ok: dict[str, bool] = {}
EXACT = N == 2  # one addition per element: gloo's order too, so bitwise equal


def in_heap(t: torch.Tensor) -> bool:
    return bool(in_shared_memory(t.detach().reshape(-1).view(torch.uint8).numpy()))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b)) if EXACT else bool(torch.allclose(a, b, atol=1e-6))


def train(view: bool, steps: int = 6) -> tuple[bool, list[torch.Tensor], DDP]:
    """The same model on ddl and on gloo, ``steps`` steps; whether parameters and the last
    gradients agree, the ddl model's gradients, and the ddl model."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 8))
    models = {"ddl": DDP(copy.deepcopy(net), bucket_cap_mb=0.25, gradient_as_bucket_view=view),
              "gloo": DDP(copy.deepcopy(net), process_group=gloo, bucket_cap_mb=0.25,
                          gradient_as_bucket_view=view)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            for k, m in models.items()}
    g = torch.Generator().manual_seed(10 + R)
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 8, (16,), generator=g)
        for k in ("ddl", "gloo"):
            opts[k].zero_grad()
            torch.nn.functional.cross_entropy(models[k](x), y).backward()
            opts[k].step()
    pairs = list(zip(models["ddl"].parameters(), models["gloo"].parameters()))
    agree = all(same(a, b) and same(a.grad, b.grad) for a, b in pairs)
    return agree, [p.grad for p, _ in pairs], models["ddl"]


def identical_on_every_rank(model: DDP) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = [torch.empty_like(flat) for _ in range(N)]
    dist.all_gather(rows, flat, group=gloo)
    return all(torch.equal(r, flat) for r in rows)


# ------------------------------------------- DDP, both bucket modes, every rank moving
for view in (False, True):
    before = shared.moved
    agree, grads, model = train(view)
    tag = "view" if view else "copy"
    ok[f"{tag}_equals_gloo"] = agree
    ok[f"{tag}_identical_on_ranks"] = identical_on_every_rank(model)
    ok[f"{tag}_moved"] = shared.moved > before
    if view:  # the gradients are views of the buckets, which now live in the heap
        ok["view_grads_in_heap"] = all(in_heap(g) for g in grads if g.numel() * 4 >= 65536)

# --------------------------------------------- one rank keeps its buckets private
if R == 1:
    shared.configure(0)
before = shared.moved
agree, _, model = train(False)
ok["mixed_equals_gloo"] = agree
ok["mixed_identical_on_ranks"] = identical_on_every_rank(model)
ok["mixed_moves_only_where_allowed"] = (shared.moved == before) if R == 1 else \
    (shared.moved > before)
shared.configure()


# --------------------------------------------- what must stay where it is
class AllreduceInBackward(torch.autograd.Function):
    """Runs ``action`` inside a backward pass (as DDP's hooks and comm hooks run)."""

    @staticmethod
    def forward(ctx, x, action):
        ctx.action = action
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.action()
        return grad, None


def in_backward(action) -> None:
    x = torch.ones(2, requires_grad=True)
    AllreduceInBackward.apply(x, action).sum().backward()


S = N * (N + 1) / 2
outside = torch.empty(1 << 16)
ptr = outside.data_ptr()
for _ in range(3):  # issued outside a backward pass: a user's tensor, left alone
    outside.fill_(R + 1)
    dist.all_reduce(outside)
ok["outside_backward_stays"] = outside.data_ptr() == ptr and not in_heap(outside)
ok["outside_backward_sum"] = bool((outside == S).all())

big = torch.empty(1 << 17)
part = big[: 1 << 16]
ptr = big.data_ptr()
for _ in range(3):  # part of a larger storage: the rest may be in use, left alone
    part.fill_(R + 1)
    in_backward(lambda: dist.all_reduce(part))
ok["partial_storage_stays"] = big.data_ptr() == ptr and not in_heap(big)
ok["partial_storage_sum"] = bool((part == S).all())

def settle() -> None:
    """Until ddl's workers have finished every job with its callbacks (a job's handle is
    done a moment before its queue stops counting it)."""
    deadline = time.monotonic() + 10
    while jobs_in_flight() and time.monotonic() < deadline:
        time.sleep(0.001)


# Several collectives on one tensor in flight at once, as a comm hook that allreduces and
# then broadcasts its bucket does: a move may only happen while no queued job can still
# read or write the tensor's old memory, and every call after it must see the new memory.
# The first step allreduces it once (seen); the second's first call moves it, with two
# more calls on it right behind.
buf = torch.empty(1 << 16)
results = []
moved_when = []
for step in range(4):
    buf.fill_(R + 1)
    before = shared.moved

    def three():
        works = [dist.all_reduce(buf, async_op=True), dist.broadcast(buf, src=N - 1,
                                                                     async_op=True),
                 dist.all_reduce(buf, async_op=True)]
        for w in works:
            w.wait()

    if step == 0:
        in_backward(lambda: dist.all_reduce(buf))
        results.append(bool((buf == S).all()))
    else:
        in_backward(three)
        results.append(bool((buf == N * S).all()))
    moved_when.append(shared.moved - before)
    settle()
ok["in_flight_three_results"] = all(results)
ok["in_flight_moved_by_the_first_call"] = moved_when == [0, 1, 0, 0]
ok["in_flight_buffer_moved"] = in_heap(buf)

# Several buffers issued back to back, random values of odd sizes, every step checked
# against gloo: each moves while the allreduces of the others are in flight, as DDP's
# buckets do.
bufs = [torch.empty(n) for n in (16384 + 7, 65536 + 21, 20000)]
results = []
for step in range(5):
    vals = [torch.randn(b.numel(), generator=torch.Generator().manual_seed(100 * step + 10 * R + i))
            for i, b in enumerate(bufs)]
    for b, v in zip(bufs, vals):
        b.copy_(v)

    def all_at_once():
        for w in [dist.all_reduce(b, async_op=True) for b in bufs]:
            w.wait()

    in_backward(all_at_once)
    for b, v in zip(bufs, vals):
        dist.all_reduce(v, group=gloo)
        results.append(same(b, v) if EXACT else bool(torch.allclose(b, v, atol=1e-5)))
    settle()
ok["back_to_back_sums"] = all(results)
ok["back_to_back_moved"] = all(in_heap(b) for b in bufs)

dist.destroy_process_group()
print(json.dumps({"rank": R, "failed": [k for k, v in ok.items() if not v],
                  "moved": shared.moved}), flush=True)
ddl.shutdown()
os._exit(0)
