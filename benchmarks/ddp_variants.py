"""The job and the variants that benchmarks/ddp_exposed.py and ddp_timeline.py compare: the
10.5 M-parameter MLP of ``train_side_by_side.py``, batch 32, one thread per rank, DDP on
the ``ddl`` backend in several settings against ddl.torch's DistributedOptimizer.

Importing it joins the job (``hvd.init()`` and ``init_process_group("ddl")``).
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from train_side_by_side import _model

import ddl
import ddl.torch as hvd

torch.set_num_threads(1)
hvd.init()
dist.init_process_group("ddl", init_method="env://")
_g = torch.Generator().manual_seed(hvd.rank())
x, y = torch.randn(32, 1024, generator=_g), torch.randint(0, 10, (32,), generator=_g)

# DDP's bucket_cap_mb per variant (25: DDP's default)
BUCKET_MB = {"ddp-view-4": 4, "ddp-view-128": 128}


def direct_hook(state, bucket):
    """A comm hook calling the core directly: no ProcessGroup, no Work, no separate div_."""
    buf, fut = bucket.buffer(), torch.futures.Future()
    ddl.allreduce_async_(buf, ddl.Average).add_done_callback(lambda _: fut.set_result(buf))
    return fut


def make(kind: str):
    """(module, optimizer) of one variant."""
    net = _model(2048)
    if kind == "compute":
        return net, torch.optim.SGD(net.parameters(), lr=0.01)
    if kind == "hvd":
        return net, hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                             named_parameters=net.named_parameters())
    d = DDP(net, gradient_as_bucket_view=kind != "ddp", bucket_cap_mb=BUCKET_MB.get(kind, 25))
    if kind == "ddp-view-hook":
        d.register_comm_hook(None, direct_hook)
    return d, torch.optim.SGD(d.parameters(), lr=0.01)
