"""DDP on the ``ddl`` backend against ddl.torch's DistributedOptimizer, side by side in one
job: where DDP's extra exposed communication goes (issue 13's performance target).

    ddlrun -n 2 python benchmarks/ddp_exposed.py [ROUNDS [VARIANT...]]

Variants, interleaved round by round on the MLP of ``train_side_by_side.py`` (10.5 M
parameters): ``compute`` (no communication), ``ddp`` (DDP's defaults: gradients copied into
its buckets and back), ``ddp-view`` (``gradient_as_bucket_view=True``: the gradients are the
buckets), ``ddp-view-hook`` (that, with a comm hook calling ``ddl.allreduce_async_`` with
Average directly: no ProcessGroup, no Work, no separate division) and ``hvd``
(DistributedOptimizer). Exposed communication = step - compute, per round (medians of 10
steps, rank 0); printed: the median over rounds, its range, and the median of each round's
ratio to hvd's.

``ddp-view-4`` is ``ddp-view`` with ``bucket_cap_mb=4``: a bucket per large layer (DDP's
default 25 MB puts two 16 MB layers in one bucket, whose allreduce cannot start before the
second is done). Variants named after ROUNDS run instead of these (with compute and hvd).
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist
from ddp_variants import make, x, y

import ddl.torch as hvd

KINDS = tuple(dict.fromkeys(("compute", *sys.argv[2:], "hvd"))) if sys.argv[2:] else (
    "compute", "ddp", "ddp-view", "ddp-view-hook", "ddp-view-4", "hvd")
runs = {k: make(k) for k in KINDS}


def step(kind):
    net, opt = runs[kind]
    t = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    return time.perf_counter() - t


# Per round: each variant's median step; exposed = that - compute's median of the same
# round, so a burst of load from elsewhere moves a round's variants together.
rounds: list[dict[str, float]] = []
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    med: dict[str, float] = {}
    for k in KINDS:
        hvd.barrier()
        for _ in range(3):
            step(k)
        med[k] = 1e3 * statistics.median([step(k) for _ in range(10)])
    rounds.append(med)
if hvd.rank() == 0:
    for k in KINDS:
        steps = [r[k] for r in rounds]
        exposed = [r[k] - r["compute"] for r in rounds]
        vs_hvd = [(r[k] - r["compute"]) / max(1e-3, r["hvd"] - r["compute"]) for r in rounds]
        print(f"{k:16s} step {statistics.median(steps):6.1f} ms  exposed "
              f"{statistics.median(exposed):6.1f} ms  (rounds {min(exposed):.0f}.."
              f"{max(exposed):.0f})  / hvd's {statistics.median(vs_hvd):5.2f}")
dist.destroy_process_group()
