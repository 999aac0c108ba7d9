"""``ddl.tensorflow``: TensorFlow 2 on the ddl core, with Horovod's API, so Horovod TF2
scripts run by changing one import::

    import ddl.tensorflow as hvd
    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)

Keras users import :mod:`ddl.keras`. See docs/tensorflow.md.
"""

from __future__ import annotations

from typing import Any

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
from ddl.hvd.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

from .compression import Compression, Compressor
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import (
    HorovodMismatchError,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job (``ddl.init()``); see :func:`ddl.hvd.lifecycle.init`."""
    _lifecycle.init(comm, process_sets, who="ddl.tensorflow")


def DistributedOptimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
    """Horovod's TensorFlow ``DistributedOptimizer``: for a Keras optimizer this is
    :func:`ddl.keras.DistributedOptimizer`. TF1 ``tf.compat.v1.train`` optimizers (graph
    mode with sessions) are not supported."""
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer):
        from ddl.keras import DistributedOptimizer as keras_distributed

        return keras_distributed(optimizer, *args, **kwargs)
    raise NotImplementedError(
        "ddl.tensorflow.DistributedOptimizer takes a Keras optimizer; for a custom loop "
        "use hvd.DistributedGradientTape (TF1 tf.compat.v1.train optimizers are not "
        "supported)")


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
    "DDLPeerError", "DDLTimeoutError", "DistributedGradientTape", "DistributedOptimizer",
    "Max", "Min", "ProcessSet", "Product", "Sum", "add_process_set", "allgather",
    "allgather_object", "remove_process_set",
    "allreduce", "alltoall", "barrier", "broadcast", "broadcast_object",
    "broadcast_variables", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "reducescatter", "rank", "rocm_built",
    "shutdown", "size", "start_timeline", "stop_timeline",
    "HorovodMismatchError", "PartialDistributedGradientTape", "broadcast_",
    "broadcast_global_variables", "local_rank_op", "local_size_op",
    "process_set_included_op", "rank_op", "size_op",
]
