"""ddl: PowerDDL's communication library.

    import ddl
    ddl.init()
    total = ddl.allreduce(np.ones(4), op=ddl.Sum)

See docs/api.md. The frameworks' adapters are ``ddl.torch`` (and, later, ``ddl.tensorflow``).
"""

from .api import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    cross_rank,
    cross_size,
    destroy_group,
    engine_name,
    get_options,
    grouped_allreduce_,
    grouped_allreduce_async_,
    init,
    is_initialized,
    local_rank,
    local_size,
    malloc,
    new_group,
    poll,
    rank,
    reduce_scatter,
    reduce_scatter_async,
    shutdown,
    size,
    split_rows,
    synchronize,
)
from .engines.segments import cleanup_job
from .errors import (
    DDLConfigError,
    DDLError,
    DDLMismatchError,
    DDLPeerError,
    DDLShmError,
    DDLTimeoutError,
)
from .groups import Group
from .ops import Average, Max, Min, Product, ReduceOp, Sum
from .runtime import Handle

__version__ = "0.1.0"

__all__ = [
    "Average", "DDLConfigError", "DDLError", "DDLMismatchError", "DDLPeerError", "DDLShmError",
    "DDLTimeoutError", "Group", "Handle", "Max", "Min", "Product", "ReduceOp", "Sum",
    "__version__", "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "cleanup_job", "cross_rank", "cross_size", "destroy_group", "engine_name",
    "get_options", "grouped_allreduce_", "grouped_allreduce_async_", "init", "is_initialized",
    "local_rank", "local_size", "malloc", "new_group", "poll", "rank", "reduce_scatter",
    "reduce_scatter_async", "shutdown", "size", "split_rows", "synchronize",
]
