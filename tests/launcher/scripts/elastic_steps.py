"""An elastic job whose result records every world it went through: each step adds, on
every element, the allreduced sum of (rank + 1) over the ranks of the world the step ran
in, so the final value is the sum over steps of size*(size+1)/2 and tells exactly which
world size each committed step had. ``state.commit()`` every COMMIT steps.

    elastic_steps.py STEPS COMMIT [kill WORKER STEP] [exit WORKER STEP CODE]
                     [killagent WORKER STEP] [hang WORKER STEP] [sleep SECONDS]
                     [mark M] [stamp PATH]

``kill W S``: the worker named W (``host:slot``) SIGKILLs itself right after step S;
``killagent W S``: it SIGKILLs its parent there, the agent of its host (a remote host's
workers then die with it: the host is lost);
``exit W S C``: it exits with code C there instead (an ordinary failure); ``hang W S``:
it sleeps for 10 minutes there (a stuck worker: its peers' collectives time out); ``sleep T``:
each step sleeps T seconds (room for discovery to change the hosts mid-run);
``mark M``: nothing but M on the command line (tests find the workers by it);
``stamp P``: every rank appends one JSON line per step to P.<worker> (step, world size);
the one that kills its agent writes the time it did to P.killed.
Rank 0 prints ``RESULT {json}`` at the end: the value, steps, the sizes seen, resets.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import ddl
import ddl.elastic as elastic
from ddl.hvd import lifecycle

args = sys.argv[1:]
STEPS, COMMIT = int(args[0]), int(args[1])
opts = args[2:]
kill = exit_at = killagent = hang = None
sleep = 0.0
stamp = None
while opts:
    what = opts.pop(0)
    if what == "kill":
        kill = (opts.pop(0), int(opts.pop(0)))
    elif what == "hang":
        hang = (opts.pop(0), int(opts.pop(0)))
    elif what == "killagent":
        killagent = (opts.pop(0), int(opts.pop(0)))
    elif what == "exit":
        exit_at = (opts.pop(0), int(opts.pop(0)), int(opts.pop(0)))
    elif what == "sleep":
        sleep = float(opts.pop(0))
    elif what == "mark":
        opts.pop(0)
    elif what == "stamp":
        stamp = opts.pop(0)
me = os.environ.get("DDL_ELASTIC_WORKER", "?")

lifecycle.init()
state = elastic.ObjectState(step=0, value=np.zeros(5), sizes=[])
resets = []
state.register_reset_callbacks([lambda: resets.append(ddl.size())])


@elastic.run
def train(state: elastic.ObjectState) -> np.ndarray:
    while state.step < STEPS:
        part = np.full(5, float(ddl.rank() + 1))
        state.value = state.value + ddl.allreduce(part, ddl.Sum)
        state.sizes = state.sizes + [ddl.size()]
        state.step += 1
        if stamp:
            with open(f"{stamp}.{me}", "a") as f:
                f.write(json.dumps({"step": state.step, "size": ddl.size()}) + "\n")
        if kill and kill == (me, state.step):
            os.kill(os.getpid(), signal.SIGKILL)
        if hang and hang == (me, state.step):
            time.sleep(600)
        if killagent and killagent == (me, state.step):
            if stamp:  # when the host was lost, on the clock the test reads too
                with open(f"{stamp}.killed", "w") as f:
                    f.write(repr(time.time()))
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(30)  # the agent's death takes this worker down (PR_SET_PDEATHSIG)
        if exit_at and exit_at[:2] == (me, state.step):
            sys.stdout.flush()
            os._exit(exit_at[2])
        if state.step % COMMIT == 0:
            state.commit()
        if sleep:
            time.sleep(sleep)
    return state.value


value = train(state)
if ddl.rank() == 0:
    print("RESULT " + json.dumps({"value": value.tolist(), "steps": state.step,
                                  "sizes": state.sizes, "resets": resets, "worker": me}),
          flush=True)
