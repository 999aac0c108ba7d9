"""A worker for one-ddlrun-per-node elastic tests: ``ready rank R restart C`` once ddl is
initialised, STEPS allreduces of ones (each must equal the world size), then one line
``done rank R of W restart C`` on stdout.

Environment: FAIL_RANK/FAIL_RESTART make that rank exit with code 3 at step 2 of that
start of the job (TORCHELASTIC_RESTART_COUNT; ``*``: every start); SLOW (seconds per
step) keeps it running; STEPS (default 5)."""

import os
import sys
import time

import numpy as np

import ddl

ddl.init()
rank, world = ddl.rank(), ddl.size()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
steps = int(os.environ.get("STEPS", "5"))
print(f"ready rank {rank} restart {restart}", flush=True)
for step in range(steps):
    if (str(rank) == os.environ.get("FAIL_RANK") and step == 2
            and os.environ.get("FAIL_RESTART", "0") in ("*", str(restart))):
        print(f"rank {rank} fails on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    x = np.ones(7, np.float32)
    ddl.allreduce_(x, ddl.Sum)
    assert (x == world).all(), (x, world)
    time.sleep(float(os.environ.get("SLOW", "0")))
print(f"done rank {rank} of {world} restart {restart} "
      f"run {os.environ['TORCHELASTIC_RUN_ID']} max {os.environ['TORCHELASTIC_MAX_RESTARTS']}",
      flush=True)
ddl.shutdown()
