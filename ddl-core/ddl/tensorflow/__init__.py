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

from ddl import keras_optimizer as _keras_optimizer
from ddl.hvd import basics as _basics
from ddl.hvd import lifecycle as _lifecycle
from ddl.hvd.basics import *  # noqa: F403 - the names every adapter has
from ddl.hvd.basics import Average, ProcessSet, global_process_set

from . import elastic, gradient_tape
from . import graph_threads as _graph_threads
from . import legacy_optimizer as _legacy_optimizer
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
from .sync_batch_norm import SyncBatchNormalization

# Before TensorFlow starts (a TF1 session sizes its thread pool when it is made, which may
# be before hvd.init()): enough inter-op threads for a graph's collectives.
_graph_threads.reserve()


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job (``ddl.init()``); see :func:`ddl.hvd.lifecycle.init`."""
    _lifecycle.init(comm, process_sets, who="ddl.tensorflow")


def DistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802
                         use_locking: bool = False, device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Horovod's TensorFlow ``DistributedOptimizer``: for a Keras optimizer this is
    :func:`ddl.keras.DistributedOptimizer` (same arguments); a TF1
    ``tf.compat.v1.train.Optimizer`` (graph mode with sessions) is wrapped as Horovod's
    ``_DistributedOptimizer`` (:mod:`.legacy_optimizer`)."""
    if _legacy_optimizer.is_legacy_optimizer(optimizer):
        reduce_args = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                           gradient_predivide_factor=gradient_predivide_factor)
        return _legacy_optimizer.LegacyDistributedOptimizer(
            optimizer, name, use_locking, reduce_args, process_set, backward_passes_per_step,
            average_aggregated_gradients)
    if not _keras_optimizer.is_keras_optimizer(optimizer):
        raise NotImplementedError(
            "ddl.tensorflow.DistributedOptimizer takes a Keras optimizer or a TF1 "
            "tf.compat.v1.train.Optimizer; for a custom loop use hvd.DistributedGradientTape")
    _keras_optimizer.check_optimizer(optimizer)
    reduction = (gradient_tape.KERAS_REDUCTION if _keras_optimizer.backend() == "tensorflow"
                 else _keras_optimizer.TORCH)
    args = _keras_optimizer.optimizer_args(
        compression, sparse_as_dense, op, gradient_predivide_factor, backward_passes_per_step,
        average_aggregated_gradients, process_set, scale_local_gradients, reduction=reduction)
    return _keras_optimizer.distributed_optimizer(optimizer, args, name,
                                                  backward_passes_per_step)


__all__ = [*_basics.__all__,
           "Compression", "Compressor", "DistributedGradientTape", "DistributedOptimizer",
           "HorovodMismatchError",
           "PartialDistributedGradientTape", "SyncBatchNormalization", "allgather", "elastic",
           "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
           "broadcast_global_variables", "broadcast_object", "broadcast_variables",
           "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "init", "join",
           "local_rank_op", "local_size_op", "process_set_included_op", "rank_op",
           "reducescatter", "size_op"]
