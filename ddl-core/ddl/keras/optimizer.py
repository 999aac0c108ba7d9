"""Horovod's Keras ``DistributedOptimizer`` and ``PartialDistributedOptimizer`` for Keras 3
(TensorFlow and torch backends): Horovod's signatures over :mod:`ddl.keras_optimizer`
(what the wrapper does, shared with ``ddl.tensorflow``), with the reduction of the Keras
backend in use.
"""

from __future__ import annotations

from typing import Any

import keras

import ddl
from ddl.hvd.compression import Compression, Compressor
from ddl.hvd.process_sets import ProcessSet, global_process_set
from ddl.keras_optimizer import (
    TORCH,
    Reduction,
    backend,
    check_optimizer,
    distribute,
    distributed_optimizer,
    is_distributed,
    local_layer_variables,
    optimizer_args,
)

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "distribute",
           "is_distributed"]


def _reduction() -> Reduction:
    if backend() == "tensorflow":
        # the tensorflow backend's gradients go through ddl.tensorflow's ops; imported
        # here, on that backend only, so the torch backend never imports TensorFlow
        from ddl.tensorflow.gradient_tape import KERAS_REDUCTION

        return KERAS_REDUCTION
    return TORCH


def _args(compression: type[Compressor], sparse_as_dense: bool, op: Any,
          gradient_predivide_factor: float, backward_passes_per_step: int,
          average_aggregated_gradients: bool, process_set: Any,
          scale_local_gradients: bool = True) -> dict:
    """:func:`ddl.keras_optimizer.optimizer_args` with this backend's reduction."""
    return optimizer_args(compression, sparse_as_dense, op, gradient_predivide_factor,
                          backward_passes_per_step, average_aggregated_gradients,
                          process_set, scale_local_gradients, reduction=_reduction())


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,  # noqa: N802
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = ddl.Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """A new optimizer of ``optimizer``'s class and config whose gradients are averaged
    (or summed, ``op=hvd.Sum``) over every rank before they are applied, as Horovod's.
    ``backward_passes_per_step=N`` accumulates N batches locally (Keras's
    ``gradient_accumulation_steps``) and applies their sum, or their average with
    ``average_aggregated_gradients=True``. Every gradient travels in one grouped call
    (fused per dtype), so ``num_groups``/``groups`` change nothing; ``device_*`` and
    ``scale_local_gradients`` are accepted for compatibility."""
    check_optimizer(optimizer)
    args = _args(compression, sparse_as_dense, op, gradient_predivide_factor,
                 backward_passes_per_step, average_aggregated_gradients, process_set,
                 scale_local_gradients)
    return distributed_optimizer(optimizer, args, name, backward_passes_per_step)


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802
                                name: str | None = None, device_dense: str = "",
                                device_sparse: str = "",
                                compression: type[Compressor] = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0,
                                op: Any = ddl.Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                groups: Any = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True
                                ) -> keras.optimizers.Optimizer:
    """Horovod's: a :func:`DistributedOptimizer` whose ``local_layers``' (one Keras
    layer or several) trainable variables are registered local variables: their
    gradients are not reduced over the ranks."""
    local_vars = local_layer_variables(local_layers)
    new = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                               sparse_as_dense, gradient_predivide_factor, op,
                               backward_passes_per_step, average_aggregated_gradients,
                               groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    for v in local_vars:
        new.register_local_var(v)
    return new
