"""DDP on the ``ddl`` backend against ddl.torch's DistributedOptimizer, side by side in one
job: where DDP's extra exposed communication goes (issue 13's performance target).

    ddlrun -n 2 python benchmarks/ddp_exposed.py [ROUNDS]

Variants, interleaved round by round on the MLP of ``python -m ddl.perf.train`` (10.5 M
parameters): ``compute`` (no communication), ``ddp`` (DDP's defaults: gradients copied into
its buckets and back), ``ddp-view`` (``gradient_as_bucket_view=True``: the gradients are the
buckets), ``ddp-view-hook`` (that, with a comm hook calling ``ddl.allreduce_async_`` with
Average directly: no ProcessGroup, no Work, no separate division) and ``hvd``
(DistributedOptimizer). Exposed communication = step - compute (medians, rank 0).
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddl
import ddl.torch as hvd
from ddl.perf.train import _model

torch.set_num_threads(1)
hvd.init()
dist.init_process_group("ddl", init_method="env://")
g = torch.Generator().manual_seed(hvd.rank())
x, y = torch.randn(32, 1024, generator=g), torch.randint(0, 10, (32,), generator=g)


def direct_hook(state, bucket):
    buf, fut = bucket.buffer(), torch.futures.Future()
    ddl.allreduce_async_(buf, ddl.Average).add_done_callback(lambda _: fut.set_result(buf))
    return fut


def make(kind):
    net = _model(2048)
    if kind == "compute":
        return net, torch.optim.SGD(net.parameters(), lr=0.01)
    if kind == "hvd":
        return net, hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                             named_parameters=net.named_parameters())
    d = DDP(net, gradient_as_bucket_view=kind != "ddp")
    if kind == "ddp-view-hook":
        d.register_comm_hook(None, direct_hook)
    return d, torch.optim.SGD(d.parameters(), lr=0.01)


KINDS = ("compute", "ddp", "ddp-view", "ddp-view-hook", "hvd")
runs = {k: make(k) for k in KINDS}


def step(kind):
    net, opt = runs[kind]
    t = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    return time.perf_counter() - t


times = {k: [] for k in KINDS}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for k in KINDS:
        hvd.barrier()
        for _ in range(3):
            step(k)
        times[k] += [step(k) for _ in range(10)]
med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
if hvd.rank() == 0:
    for k in KINDS:
        print(f"{k:14s} step {med[k]:6.1f} ms  exposed {med[k] - med['compute']:6.1f} ms")
dist.destroy_process_group()
