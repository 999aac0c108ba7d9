"""The names every framework adapter re-exports (Horovod's ``HorovodBasics``): ranks and
sizes, errors, reduction ops, process sets, what this build has, shutdown and the
timeline. ``ddl.torch`` and ``ddl.tensorflow`` re-export all of :data:`__all__`,
``ddl.keras`` the part Horovod's Keras API has; each adapter adds its own ``init()`` (which
names it in errors) and its collectives. Framework-free, as the rest of :mod:`ddl.hvd`.
"""

from __future__ import annotations

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
from ddl.errors import HorovodInternalError, HostsUpdatedInterrupt

from .adasum import Adasum
from .lifecycle import (
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
from .process_sets import (  # noqa: F401 - Horovod's tests read the private one
    ProcessSet,
    _get_process_set_ids_and_ranks,
    add_process_set,
    global_process_set,
    remove_process_set,
)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record this rank's timeline (a Chrome/Perfetto trace) into ``file_path`` with
    ``.rankN`` before its ``.json``; see :mod:`ddl.timeline`. ``mark_cycles`` adds an
    instant event each time ddl's worker starts on queued work after idling."""
    _timeline.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording and write the file."""
    _timeline.stop_timeline()


__all__ = [
    # errors
    "DDLConfigError", "DDLError", "DDLMismatchError", "DDLPeerError", "DDLTimeoutError",
    "HorovodInternalError", "HostsUpdatedInterrupt",
    # reduction ops
    "Adasum", "Average", "Max", "Min", "Product", "Sum",
    # the job
    "cross_rank", "cross_size", "is_homogeneous", "is_initialized", "local_rank",
    "local_size", "rank", "size", "shutdown",
    # process sets
    "ProcessSet", "add_process_set", "global_process_set", "remove_process_set",
    # what this build has
    "ccl_built", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rocm_built",
    # the timeline
    "start_timeline", "stop_timeline",
]
