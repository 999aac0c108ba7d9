"""One rank of the timeline tests: ``python timeline.py MODE [PATH]``. Prints one JSON line.

- ``record``: ddl.allreduce (blocking, async; one that rank 1 joins 0.3 s late), hvd-level
  calls (negotiated) and a few steps of ddl.torch's DistributedOptimizer, with DDL_TIMELINE
  set by the test;
- ``hvd``: the same steps between ``hvd.start_timeline(PATH, mark_cycles=True)`` and
  ``hvd.stop_timeline()`` (ddl.torch), then more steps that must not be recorded;
- ``profiler``: the steps, and a ``ddl``-backend allreduce, under ``torch.profiler``;
  reports the names of ``key_averages()``;
- ``dump``: allreduces with ``-dump_iter`` in DDL_OPTIONS (the test reads stderr); argv[3]
  the element counts, comma-separated.
"""

import json
import sys
import time

import numpy as np

MODE = sys.argv[1]


def steps(hvd, torch, n=3):
    """Training steps whose buckets are packed into a fusion buffer (fp16 compression)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    for _ in range(n):
        opt.zero_grad()
        model(torch.ones(4, 8) * (hvd.rank() + 1)).sum().backward()
        opt.step()
    opt.remove_hooks()


def core_calls(ddl):
    x = np.arange(256, dtype=np.float32)  # 1 KiB
    for _ in range(3):
        ddl.allreduce(x)
    handles = [ddl.allreduce_async(x) for _ in range(4)]
    for h in handles:
        h.wait()
    ddl.allgather(x[:4].copy())


if MODE == "dump":
    import ddl

    ddl.init()
    rank = ddl.rank()
    # element counts (default 1024: 4 KiB), each allreduced argv[2] times
    for count in map(int, (sys.argv[3] if len(sys.argv) > 3 else "1024").split(",")):
        x = np.ones(count, dtype=np.float32)
        for _ in range(int(sys.argv[2])):
            ddl.allreduce(x)
    ddl.shutdown()
    print(json.dumps({"rank": rank}))
    sys.exit(0)

import torch  # noqa: E402

import ddl  # noqa: E402
import ddl.torch as hvd  # noqa: E402

hvd.init()
report = {"rank": hvd.rank()}
if MODE == "record":
    core_calls(ddl)
    if hvd.rank() == 1:
        time.sleep(0.3)
    ddl.allreduce(np.ones(16, dtype=np.float32))  # rank 0 waits for its late peer
    hvd.allreduce(torch.ones(5), name="named.one")
    steps(hvd, torch)
elif MODE == "hvd":
    try:
        hvd.start_timeline("")
    except ddl.DDLConfigError:
        report["empty_path_refused"] = True
    hvd.start_timeline(sys.argv[2], mark_cycles=True)
    core_calls(ddl)
    steps(hvd, torch)
    hvd.stop_timeline()
    hvd.stop_timeline()  # a second stop does nothing
    hvd.allreduce(torch.ones(3), name="after.stop")
elif MODE == "profiler":
    import torch.distributed as dist

    dist.init_process_group("ddl", init_method="env://")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        core_calls(ddl)
        steps(hvd, torch)
    report["names"] = sorted({e.key for e in prof.key_averages()})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = torch.ones(64)
        dist.all_reduce(t)  # the Work: "ddl:allreduce"; its core call: "ddl:torch.allreduce"
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, 0)
    report["backend_names"] = sorted({e.key for e in prof.key_averages()})
    dist.destroy_process_group()
hvd.shutdown()
print(json.dumps(report))
