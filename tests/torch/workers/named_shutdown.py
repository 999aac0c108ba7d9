"""Rank 0 waits on a named allreduce that rank 1 never submits; rank 1 calls
hvd.shutdown(). As in Horovod, the shutdown ends the pending operation: rank 0's
synchronize raises (it used to wait forever, and rank 1's shutdown with it), then both go
on: a second job's worth of calls in step after a new init."""

import torch

import ddl.torch as hvd

hvd.init()
if hvd.rank() == 0:
    h = hvd.allreduce_async(torch.ones(3), name="tensor_a")
    try:
        hvd.synchronize(h)
        print("rank 0: returned", flush=True)
    except hvd.HorovodInternalError as exc:
        print(f"rank 0 raised {type(exc).__name__}: {exc}", flush=True)
    hvd.shutdown()
else:
    hvd.shutdown()
    print("rank 1: shutdown returned", flush=True)
hvd.init()
print(f"rank {hvd.rank()} sum {hvd.allreduce(torch.ones(2), op=hvd.Sum, name='b').tolist()}",
      flush=True)
hvd.shutdown()
