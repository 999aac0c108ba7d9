"""Holds ddl.malloc buffers (segments that live until shutdown), then the last rank is
SIGKILLed mid-job: the launcher's cleanup must remove what it leaves behind."""

import os
import signal

import numpy as np

import ddl

ddl.init()
bufs = [ddl.malloc((1 << 18,), np.float32) for _ in range(3)]
for b in bufs:
    b[:] = ddl.rank()
    ddl.allreduce_(b, op=ddl.Sum)
print("segments:", sorted(n for n in os.listdir("/dev/shm") if os.environ["DDL_JOB_ID"] in n),
      flush=True)
if ddl.rank() == ddl.size() - 1:
    os.kill(os.getpid(), signal.SIGKILL)
ddl.allreduce_(bufs[0], op=ddl.Sum)  # the survivors fail here with DDLPeerError
