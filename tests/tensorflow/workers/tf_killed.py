"""Rank 1 dies (exit 7) in the middle of training; rank 0 is inside a tf.function
allreduce at that moment and must fail fast with ddl's error, not hang."""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import ddl.tensorflow as hvd  # noqa: E402

hvd.init()


@tf.function
def step(x):
    return hvd.allreduce(x)


for _ in range(3):
    step(tf.ones([1000]))
if hvd.rank() == 1:
    os._exit(7)  # killed: no shutdown, no goodbye
time.sleep(0.5)
t0 = time.monotonic()
try:
    step(tf.ones([1000]))
    print("NO ERROR", flush=True)
except tf.errors.OpError as exc:
    print(f"RAISED after {time.monotonic() - t0:.1f}s: {str(exc).splitlines()[0][:200]}",
          flush=True)
    print("DDL" in str(exc) and "rank 1" in str(exc), flush=True)
sys.exit(3)
