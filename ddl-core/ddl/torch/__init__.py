"""``ddl.torch``: PyTorch on the ddl core, two ways.

Horovod's API, so Horovod scripts run by changing one import::

    import ddl.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

and a ``torch.distributed`` backend named ``ddl`` (registered by this import)::

    torch.distributed.init_process_group("ddl", init_method="env://")
    model = torch.nn.parallel.DistributedDataParallel(model)

See docs/pytorch.md.
"""

from __future__ import annotations

from typing import Any

import torch.distributed  # noqa: F401 - the backend registers with it

from ddl.hvd import basics as _basics
from ddl.hvd import lifecycle as _lifecycle
from ddl.hvd.basics import *  # noqa: F403 - the names every adapter has
from ddl.hvd.compression import Compression, Compressor
from ddl.hvd.negotiate import Handle

from . import elastic
from .backend import DDLProcessGroup, DDLWork, register
from .functions import broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reduce_scatter,
    reduce_scatter_async,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

register()


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job (``ddl.init()``); see :func:`ddl.hvd.lifecycle.init`. Calling it again
    is a no-op unless a peer shut down, died or timed out: then it starts a new generation
    (Horovod's tests do init, shutdown, init between cases)."""
    _lifecycle.init(comm, process_sets, who="ddl.torch")


__all__ = [*_basics.__all__,
           "Compression", "Compressor", "DDLProcessGroup", "DDLWork", "DistributedOptimizer",
           "Handle", "SyncBatchNorm", "allgather", "allgather_async", "allgather_object",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
           "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
           "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters", "elastic", "grouped_allgather", "grouped_allgather_async",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
           "init", "join", "poll", "reduce_scatter", "reduce_scatter_async", "reducescatter",
           "reducescatter_async", "register", "sparse_allreduce_async", "synchronize"]
