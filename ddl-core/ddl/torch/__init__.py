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

from ddl import (
    Average,
    DDLConfigError,
    DDLError,
    DDLMismatchError,
    DDLPeerError,
    DDLTimeoutError,
    Max,
    Min,
    Product,
    Sum,
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from ddl import timeline as _timeline
from ddl.hvd import lifecycle as _lifecycle
from ddl.hvd.adasum import Adasum
from ddl.hvd.compression import Compression, Compressor
from ddl.hvd.lifecycle import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    shutdown,
)
from ddl.hvd.negotiate import Handle

from .backend import DDLProcessGroup, DDLWork, register
from .functions import broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (
    ProcessSet,
    add_process_set,
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
    global_process_set,
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
    remove_process_set,
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


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record this rank's timeline (a Chrome/Perfetto trace) into ``file_path`` with
    ``.rankN`` before its ``.json``; see :mod:`ddl.timeline`. ``mark_cycles`` adds an
    instant event each time ddl's worker starts on queued work after idling."""
    _timeline.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording and write the file."""
    _timeline.stop_timeline()


__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DDLConfigError", "DDLError",
    "DDLMismatchError",
    "DDLPeerError", "DDLProcessGroup", "DDLTimeoutError", "DDLWork", "DistributedOptimizer",
    "Handle", "Max", "Min", "ProcessSet", "Product", "Sum", "add_process_set", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reduce_scatter",
    "reduce_scatter_async", "reducescatter", "reducescatter_async", "register",
    "remove_process_set", "rocm_built", "sparse_allreduce_async",
    "shutdown", "size", "start_timeline", "stop_timeline", "synchronize", "SyncBatchNorm",
]
