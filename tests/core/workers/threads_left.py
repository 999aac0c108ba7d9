"""Counts this process's OS threads before ddl.init, while collectives run and after
ddl.shutdown: a communication thread that outlives shutdown may be torn down by the
interpreter's own exit, which is where a torch process group aborts the process."""

import json
import os
import time

import numpy as np
import torch

torch.set_num_threads(1)
torch.ones(1 << 16).sum()  # torch's own pools start now, not in the middle of the count

import ddl  # noqa: E402


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


before = threads()
ddl.init()
group = ddl.new_group([0, ddl.size() - 1]) if ddl.rank() in (0, ddl.size() - 1) else None
for n in (7, 100_001):
    x = np.full(n, ddl.rank() + 1, np.float32)
    ddl.allreduce_(x, op=ddl.Sum)
    assert x[0] == sum(range(1, ddl.size() + 1)), x[0]
    if group is not None:
        ddl.allreduce_(x, group=group)
ddl.broadcast_(np.zeros(5, np.int64), root_rank=1)
if os.environ.get("DDL_DEVICE_ENGINE"):  # torch tensors through the device engine's groups
    t = torch.ones(1001)
    ddl.allreduce_(t, op=ddl.Sum)
    assert t[0].item() == ddl.size()
ddl.barrier()
during = threads()
ddl.shutdown()
# join() returns once a thread's Python part is done; its OS task may take a moment more
# to go (rank 0's rendezvous thread was caught so, 3 runs in 8): give that moment, no more
deadline = time.monotonic() + 2.0
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"rank": int(os.environ["RANK"]), "before": before, "during": during,
                  "after": threads()}))
