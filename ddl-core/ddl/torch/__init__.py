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

import importlib.util
from typing import Any

import torch.distributed

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
    engine_name,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from ddl import init as _core_init
from ddl import shutdown as _core_shutdown

from .backend import DDLProcessGroup, DDLWork, register
from .compression import Compression, Compressor
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
    shutdown_exchange,
    synchronize,
)
from .negotiate import Handle
from .negotiate import broken as _broken
from .negotiate import reset as _reset
from .optimizer import DistributedOptimizer

register()


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job (``ddl.init()``). Horovod's ``comm`` (an MPI communicator) and
    ``process_sets`` are accepted only when they mean "every rank".

    Calling it again is a no-op, as in Horovod, unless this generation is unusable (a peer
    shut down, died or timed out): then it starts a new one, which is how a rank whose peer
    called ``shutdown()`` and ``init()`` (Horovod's tests do, between cases) catches up.
    """
    if comm is not None:
        raise NotImplementedError("ddl.torch.init: comm= is not supported; ddl.init() reads "
                                  "the launch environment (ddlrun, torchrun, mpirun)")
    if process_sets:
        raise NotImplementedError("ddl.torch.init: process_sets are not supported")
    if is_initialized():
        if _broken() is None:
            return
        _core_shutdown()  # no collective step: the peers are gone or have moved on
    _reset()
    _core_init()


def shutdown() -> None:
    """Leave the job, collectively: every rank finishes the calls before this one, then
    takes part in one control exchange, so a rank still inside another collective raises a
    ``DDLMismatchError`` naming this shutdown (and re-initialises on its next ``init()``).
    ``init()`` may follow, any number of times. Safe to call more than once."""
    if not is_initialized():
        return
    try:
        if _broken() is None:
            shutdown_exchange()
    except DDLError:
        pass  # a peer is gone or elsewhere: it has been told, or will see this rank closed
    finally:
        try:
            _core_shutdown()
        finally:
            _reset()


# What this build has, in Horovod's vocabulary (scripts branch on these).
def mpi_threads_supported() -> bool:
    return False


def _transport() -> str:
    name = engine_name() if is_initialized() else ""
    return name.partition("/")[2]  # "ddl/mpi" -> "mpi"; single host: ""


def mpi_enabled() -> bool:
    """True when this job's cross-host dimensions run on MPI."""
    return _transport() == "mpi"


def mpi_built() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    """True when this job's cross-host dimensions run on Gloo."""
    return _transport() == "gloo"


def gloo_built() -> bool:
    return torch.distributed.is_gloo_available()


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return True


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def is_homogeneous() -> bool:
    return True


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise NotImplementedError("ddl.torch: the Horovod timeline is not supported")


def stop_timeline() -> None:
    raise NotImplementedError("ddl.torch: the Horovod timeline is not supported")


def __getattr__(name: str) -> Any:
    # hvd.Adasum is absent on purpose: an approximate Adasum would train differently
    # without saying so.
    if name == "Adasum":
        raise AttributeError(
            "ddl.torch has no Adasum: it is not implemented; use op=hvd.Average (the "
            "default) or hvd.Sum"
        )
    raise AttributeError(f"module 'ddl.torch' has no attribute {name!r}")


__all__ = [
    "Average", "Compression", "Compressor", "DDLConfigError", "DDLError", "DDLMismatchError",
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
    "reduce_scatter_async", "reducescatter", "reducescatter_async", "register", "rocm_built",
    "shutdown", "size", "start_timeline", "stop_timeline", "synchronize",
]
