"""Per step, when each gradient allreduce is issued, starts and ends, against the end of
backward's compute, for DDP on the ``ddl`` backend and for ddl.torch's DistributedOptimizer
(issue 13's performance target: where DDP's extra exposed communication goes).

    ddlrun -n 2 python benchmarks/ddp_timeline.py [STEPS] [VARIANT...]

Same MLP, batch and variants as ``benchmarks/ddp_exposed.py``, plus ``ddp-view-128``
(``gradient_as_bucket_view`` with ``bucket_cap_mb=128``, hvd's fusion threshold: one bucket)
and ``ddp-view-4`` (``bucket_cap_mb=4``: about a bucket per layer, as hvd's cycle time
splits its plan). Rank 0's medians over the steps, in ms:
``grads`` is when the last gradient was accumulated (compute done, from the step's start);
every other time is from ``grads``: ``bwd`` when ``backward()`` returned, ``end`` when
``opt.step()`` returned (``end`` is the step's tail after compute: its exposed
communication plus the optimizer's update). Each collective row: ``issue`` (submitted),
``start``/``done`` (ran on ddl's worker), from ddl's timeline; negative: before compute
ended.
"""

import statistics
import sys

import torch
import torch.distributed as dist
from ddp_variants import make, x, y
from torch.nn.parallel import DistributedDataParallel as DDP

import ddl.torch as hvd
from ddl import timeline as tl

clock = tl.clock

KINDS = tuple(sys.argv[2:]) or ("compute", "ddp", "ddp-view", "ddp-view-hook", "ddp-view-4",
                                "ddp-view-128", "hvd")
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
runs = {k: make(k) for k in KINDS}
marks: dict[str, float] = {}


def on_first_layer(_p):
    # the first layer's gradients are backward's last: after them only communication is left
    marks["grads"] = clock()


for net, _ in runs.values():
    first = net.module[0] if isinstance(net, DDP) else net[0]
    first.weight.register_post_accumulate_grad_hook(on_first_layer)


def step(kind):
    net, opt = runs[kind]
    t = clock()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    marks["bwd"] = clock()
    opt.step()
    marks["end"] = clock()
    return t


def collectives(t0, t1):
    """(issue, start, done, name) of each collective this rank ran between t0 and t1."""
    rec = tl.recorder
    ev = [e for e in list(rec.events) if t0 <= e[3] <= t1]
    queued = sorted((e[3], e[4]) for e in ev if e[1] == "queue")
    ran = sorted((e[3], e[4], e[0]) for e in ev if e[1] == "collective")
    out = []
    for i, (s, d, name) in enumerate(ran):
        issue = queued[i][0] if i < len(queued) else s
        out.append((issue, s, d, name))
    return out


rows = {k: [] for k in KINDS}
tl.start_timeline("/tmp/ddp_timeline.{rank}.json")
for _ in range(3):
    for k in KINDS:
        hvd.barrier()
        for _ in range(3):
            step(k)
        for _ in range(max(1, STEPS // 3)):
            t = step(k)
            tl.recorder.events.clear()  # keep only this step's
            t = step(k)
            m = dict(marks)
            z = m["grads"]
            rows[k].append((z - t, m["bwd"] - z, m["end"] - z,
                            [(a - z, b - z, c - z, n) for a, b, c, n in
                             collectives(t, m["end"])]))
tl.recorder = None  # nothing to write


def ms(v):
    return f"{1e3 * statistics.median(v):6.1f}"


if hvd.rank() == 0:
    for k in KINDS:
        r = rows[k]
        print(f"{k:13s} grads {ms([a for a, _, _, _ in r])}  bwd {ms([b for _, b, _, _ in r])}"
              f"  end {ms([c for _, _, c, _ in r])}  (ms)")
        counts = {len(c) for *_, c in r}
        n = min(counts) if counts else 0
        for i in range(n):
            print(f"    #{i} {r[0][3][i][3]:22s} issue {ms([c[i][0] for *_, c in r])}"
                  f"  start {ms([c[i][1] for *_, c in r])}"
                  f"  done {ms([c[i][2] for *_, c in r])}"
                  f"  ran {ms([c[i][2] - c[i][1] for *_, c in r])}")
        if len(counts) > 1:
            print(f"    (collectives per step vary: {sorted(counts)})")
dist.destroy_process_group()
