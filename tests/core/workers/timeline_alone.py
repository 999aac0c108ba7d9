"""Rank 0 alone records a timeline (argv[1]: its path): small and large allreduces, core and
Horovod-level, must be right on every rank. Whether a small allreduce rides on the identity
round across hosts used to depend on the timeline, which only rank 0 had on: every rank
then raised a false DDLMismatchError. Prints one JSON line."""

import json
import sys

import numpy as np

import ddl
from ddl import timeline
from ddl.hvd import collectives, lifecycle

lifecycle.init()
R, N = ddl.rank(), ddl.size()
if R == 0:
    timeline.start_timeline(sys.argv[1])
want = N * (N - 1) / 2
out = {"rank": R, "right": []}
for count in (16, 1 << 14):
    x = np.full(count, float(R), np.float32)
    out["right"].append(bool(np.all(ddl.allreduce(x, ddl.Sum) == want)))
    out["right"].append(bool(np.all(collectives.allreduce(x, op=ddl.Sum) == want)))
if R == 0:
    timeline.stop_timeline()
print(json.dumps(out), flush=True)
ddl.shutdown()
