"""A rank dies during training: the others must raise a DDL error, not hang.

argv[1]: "hvd" (DistributedOptimizer) or "ddp" (DDP on the "ddl" backend).
The last rank exits with code 3 at step 3; survivors print what they caught and exit 1.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import ddl.torch as hvd

torch.set_num_threads(1)
mode = sys.argv[1]
hvd.init()
R, N = hvd.rank(), hvd.size()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
if mode == "ddp":
    dist.init_process_group("ddl", init_method="env://")
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
else:
    model = net
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters())
t0 = time.monotonic()
try:
    for step in range(50):
        if step == 3 and R == N - 1:
            os._exit(3)
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
except Exception as exc:  # noqa: BLE001 - report whatever surfaced
    chain, e = [], exc
    while e is not None:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    print(json.dumps({"rank": R, "error": type(exc).__name__, "chain": chain,
                      "is_ddl": isinstance(exc, hvd.DDLError) or "DDLPeerError" in str(exc),
                      "seconds": time.monotonic() - t0}), flush=True)
    sys.exit(1)
print(json.dumps({"rank": R, "error": None}), flush=True)
