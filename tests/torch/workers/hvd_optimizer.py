"""DistributedOptimizer correctness: N ranks x batch B == one process x batch N*B, for
several fusion settings, fp16 compression, gradient accumulation, explicit groups,
predivision, synchronize/skip_synchronize, with a frozen layer and an unused parameter."""

import json
import os

import torch

import ddl.torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
B, STEPS, DIM = 6, 4, 12
DEV = torch.device(os.environ.get("DDL_TEST_DEVICE", "cpu"))  # "cuda" in the GPU test


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.a = torch.nn.Linear(DIM, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 4)
        self.unused = torch.nn.Parameter(torch.ones(7))  # never gets a gradient

    def forward(self, x):
        x = torch.relu(self.frozen(x))
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(N * B, DIM, generator=g).to(DEV),
            torch.randint(0, 4, (N * B,), generator=g).to(DEV))


def reference(steps, clip=None):
    """One process, the whole batch of every rank."""
    torch.manual_seed(0)
    net = Net().to(DEV)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return net


def distributed(steps, bpps=1, clip=None, set_to_none=True, case="", **kw):
    torch.manual_seed(0)
    net = Net().to(DEV)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=net.named_parameters(),
                                   backward_passes_per_step=bpps, **kw)
    for s in range(steps):
        x, y = batch(s)
        x, y = x[R * B:(R + 1) * B], y[R * B:(R + 1) * B]
        opt.zero_grad(set_to_none=set_to_none)
        for part in range(bpps):  # accumulate: bpps passes over slices of this rank's batch
            sl = slice(part * B // bpps, (part + 1) * B // bpps)
            loss = torch.nn.functional.cross_entropy(net(x[sl]), y[sl]) / bpps
            loss.backward()
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        modes.setdefault(case, []).append(opt.exchange_modes)
    return net, opt


def diff(a, b):
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(),
                                                                      b.parameters()))


ref = reference(STEPS)
modes: dict[str, list] = {}  # where each bucket's direct allreduce put its sums, per step
res: dict[str, float] = {}
buckets: dict[str, int] = {}
cases = {
    "default": {},
    "small_buckets": {"fusion_threshold_bytes": 1024, "cycle_time_ms": 0},
    "no_fusion": {"fusion_threshold_bytes": 0},
    "timed_plan": {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 1e-6},
    "num_groups": {"num_groups": 2},
    "predivide": {"gradient_predivide_factor": 2.0},
    "sum_op": {"op": hvd.Sum},  # compared against N x the reference gradient below
    "fp16": {"compression": hvd.Compression.fp16},
    "accumulate": {"bpps": 2},
    # zero_grad(set_to_none=False): gradients kept across steps end up in the buffers
    "kept_grads": {"set_to_none": False, "cycle_time_ms": 0},  # cycle 0: one plan
    "kept_grads_accumulate": {"set_to_none": False, "bpps": 2, "cycle_time_ms": 0},
    "accumulate_fp16_small": {"bpps": 3, "compression": hvd.Compression.fp16,
                              "fusion_threshold_bytes": 2048},
}
for name, kw in cases.items():
    if name == "sum_op":
        # One step: Sum of the per-rank mean gradients is N x the global mean gradient.
        torch.manual_seed(0)
        net = Net().to(DEV)
        inner = torch.optim.SGD(net.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(inner, named_parameters=net.named_parameters(), op=hvd.Sum)
        x, y = batch(0)
        mine = slice(R * B, (R + 1) * B)
        torch.nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
        opt.synchronize()
        torch.manual_seed(0)
        one = Net().to(DEV)
        torch.nn.functional.cross_entropy(one(x), y).backward()
        res[name] = max(float((p.grad - N * q.grad).abs().max()) for p, q in zip(
            [net.a.weight, net.c.bias], [one.a.weight, one.c.bias]))
        continue
    bpps = kw.pop("bpps", 1)
    net, opt = distributed(STEPS, bpps=bpps, case=name, **kw)
    res[name] = diff(net, ref)
    buckets[name] = len(opt.buckets)
    res[name + "_unused_unchanged"] = float((net.unused.detach() - 1).abs().max())
    res[name + "_frozen_unchanged"] = diff(net.frozen, ref.frozen)
net, _ = distributed(STEPS, clip=0.05)
res["clip"] = diff(net, reference(STEPS, clip=0.05))
print(json.dumps({"rank": R, "diff": res, "buckets": buckets, "modes": modes}))
