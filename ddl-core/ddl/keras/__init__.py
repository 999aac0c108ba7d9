"""``ddl.keras``: Horovod's ``horovod.tensorflow.keras`` API for Keras 3, on the
tensorflow and torch backends::

    import ddl.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    model.fit(x, y, callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)

XLA cannot compile ddl's collectives (they run as ``tf.numpy_function``): a model whose
optimizer is a DistributedOptimizer trains with ``jit_compile`` off on the tensorflow
backend, with one warning, even where Keras's ``jit_compile="auto"`` would turn XLA on (it
does when a GPU is present). See docs/tensorflow.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import keras

from ddl.hvd import collectives as C
from ddl.hvd import lifecycle as _lifecycle
from ddl.hvd.basics import (
    Average,
    DDLConfigError,
    DDLError,
    DDLMismatchError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    cross_rank,
    cross_size,
    global_process_set,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from ddl.hvd.compression import Compression, Compressor

from . import callbacks, elastic
from .optimizer import (
    DistributedOptimizer,
    PartialDistributedOptimizer,
    _args,
    distribute,
    is_distributed,
)
from .variables import broadcast_variables, model_variables, numpy_of


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job (``ddl.init()``); see :func:`ddl.hvd.lifecycle.init`."""
    _lifecycle.init(comm, process_sets, who="ddl.keras")


def broadcast_global_variables(root_rank: int, model: Any = None) -> None:
    """Horovod's ``broadcast_global_variables``: Keras 3 keeps no global collection of
    variables, so pass the model: its variables and its optimizer's get ``root_rank``'s
    values (``BroadcastGlobalVariablesCallback`` does this inside ``fit``)."""
    if model is None:
        raise DDLConfigError(
            "ddl.keras.broadcast_global_variables(root_rank, model): Keras 3 has no global "
            "variables; pass the model (or use BroadcastGlobalVariablesCallback)")
    broadcast_variables(model_variables(model), root_rank)


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: type[Compressor] = Compression.none) -> Any:
    """The Average (or ``op``) over ranks of a value (eager: a number, array or tensor),
    as a tensor of the Keras backend."""
    out = C.allreduce(numpy_of(value), average=average, name=name, op=op,
                      prescale=prescale_factor, postscale=postscale_factor)
    return keras.ops.convert_to_tensor(out)


def allgather(value: Any, name: str | None = None) -> Any:
    """Every rank's value concatenated along the first dimension (eager)."""
    return keras.ops.convert_to_tensor(C.allgather(numpy_of(value), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """``root_rank``'s value on every rank (eager)."""
    return keras.ops.convert_to_tensor(C.broadcast(numpy_of(value), root_rank, name=name))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    return C.broadcast_object(obj, root_rank, name)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    return C.allgather_object(obj, name)


def load_model(filepath: str, custom_optimizers: Sequence[type] | None = None,
               custom_objects: dict | None = None,
               compression: type[Compressor] = Compression.none, **kwargs: Any) -> Any:
    """``keras.models.load_model``, with the model's optimizer (its state kept) made a
    DistributedOptimizer, as Horovod's ``load_model``. ``custom_optimizers`` are optimizer
    classes the file refers to that Keras does not know."""
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None, **kwargs)
    if getattr(model, "optimizer", None) is not None:
        distribute(model.optimizer, _args(
            compression, sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
            backward_passes_per_step=1, average_aggregated_gradients=False,
            process_set=global_process_set))
    return model


def _no_xla_with_ddl() -> None:
    """Keras reads ``model.jit_compile`` when it builds the train step: answer False for
    a model trained with a DistributedOptimizer on the tensorflow backend, once warned."""
    from keras.src.trainers.trainer import Trainer

    prop = Trainer.__dict__.get("jit_compile")
    if not isinstance(prop, property) or getattr(prop.fget, "_ddl", False):
        return

    def fget(self: Any) -> Any:
        value = prop.fget(self)
        if value and keras.backend.backend() == "tensorflow" and is_distributed(
                getattr(self, "optimizer", None)):
            warnings.warn("ddl.keras: XLA cannot compile ddl's collectives; training with "
                          "jit_compile=False", stacklevel=2)
            prop.fset(self, False)
            return False
        return value

    fget._ddl = True  # type: ignore[attr-defined]
    Trainer.jit_compile = property(fget, prop.fset, prop.fdel, prop.__doc__)


_no_xla_with_ddl()

__all__ = [
    "Average", "Compression", "Compressor", "DDLConfigError", "DDLError", "DDLMismatchError",
    "DistributedOptimizer", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "PartialDistributedOptimizer", "ProcessSet",
    "Product", "Sum", "allgather",
    "allgather_object", "allreduce", "broadcast", "broadcast_global_variables",
    "broadcast_object", "broadcast_variables", "callbacks", "cross_rank", "cross_size",
    "elastic",
    "global_process_set", "init", "is_initialized", "load_model", "local_rank",
    "local_size", "rank", "shutdown", "size",
]
