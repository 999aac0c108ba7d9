"""Horovod's Keras ``DistributedOptimizer`` for Keras 3 (TensorFlow and torch backends).

The wrapper is a subclass of the optimizer's own class, made on the fly, that keeps the
class's name and module (a saved ``.keras`` model then loads with or without ddl) and
overrides one step of Keras's ``apply``: the gradients are reduced over every rank (one
grouped call, fused per dtype) right before Keras clips them, on update steps only. So
``clipnorm`` sees the averaged gradients as in Horovod, and with
``backward_passes_per_step=N`` (Keras's own ``gradient_accumulation_steps``) gradients are
accumulated locally and travel once every N steps.
"""

from __future__ import annotations

from typing import Any

import keras

import ddl
from ddl.hvd.compression import Compression, Compressor
from ddl.hvd.process_sets import ProcessSet, global_process_set, scope

from .variables import local_layer_variables

_CLASSES: dict[type, type] = {}
_BACKENDS = ("tensorflow", "torch")


def _backend() -> str:
    name = keras.backend.backend()
    if name not in _BACKENDS:
        raise NotImplementedError(
            f"ddl.keras supports the tensorflow and torch backends of Keras 3, not {name!r} "
            "(set KERAS_BACKEND=tensorflow or torch)")
    return name


def _reduce_tf(grads: list[Any], args: dict, variables: list[Any], local: dict
               ) -> list[Any]:
    from ddl.tensorflow import compression as tf_compression
    from ddl.tensorflow.gradient_tape import reduce_with_locals

    # Horovod's Compression.fp16 for TF casts in the graph: ddl.tensorflow's own.
    compression = (tf_compression.FP16Compressor
                   if args["compression"] is Compression.fp16 else args["compression"])
    return reduce_with_locals(grads, variables, local, args["scale_local"],
                              args["process_set"], compression=compression,
                              sparse_as_dense=args["sparse_as_dense"], op=args["op"],
                              gradient_predivide_factor=args["predivide"])


def _reduce_torch(grads: list[Any], args: dict, variables: list[Any], local: dict
                  ) -> list[Any]:
    import ddl.torch as hvd_torch

    is_local = [id(v) in local for v in variables] if local else [False] * len(grads)
    at = [i for i, g in enumerate(grads) if g is not None and not is_local[i]]
    pre, post, op = 1.0, 1.0, args["op"]
    if args["predivide"] != 1.0:
        n = scope(args["process_set"]).size
        pre, post, op = 1.0 / args["predivide"], args["predivide"] / n, ddl.Sum
    reduced = hvd_torch.grouped_allreduce([grads[i] for i in at], op=op,
                                          compression=args["compression"],
                                          prescale_factor=pre, postscale_factor=post,
                                          process_set=args["process_set"])
    out = list(grads)
    for i, r in zip(at, reduced):
        out[i] = r
    if args["scale_local"]:
        n = scope(args["process_set"]).size
        out = [g / n if loc and g is not None else g for g, loc in zip(out, is_local)]
    return out


def _distributed_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is not None:
        return cls

    def _backend_apply_gradients(self: Any, grads: Any, trainable_variables: Any) -> Any:
        # Keras passes _clip_gradients the gradients alone: note whose they are (the
        # variables left after Keras dropped those without a gradient).
        # (object.__setattr__: Keras would track the variables as the optimizer's own, and
        # save and restore them with its state)
        object.__setattr__(self, "_ddl_vars", list(trainable_variables))
        try:
            return base._backend_apply_gradients(self, grads, trainable_variables)
        finally:
            object.__setattr__(self, "_ddl_vars", None)

    def _clip_gradients(self: Any, grads: Any) -> Any:
        args = self._ddl_args
        grads = list(grads)
        local = getattr(self, "_ddl_local", None) or {}
        variables = getattr(self, "_ddl_vars", None)
        if local and (variables is None or len(variables) != len(grads)):
            raise ddl.DDLError("DistributedOptimizer: the variables of the gradients are "
                               "unknown here, so local variables cannot be told apart")
        if ddl.size() > 1:
            grads = (_reduce_tf if _backend() == "tensorflow" else _reduce_torch)(
                grads, args, variables or [None] * len(grads), local)
        if args["sum_steps"] != 1:
            # Keras averages the accumulated steps; Horovod's default is their sum.
            grads = [None if g is None else g * args["sum_steps"] for g in grads]
        return base._clip_gradients(self, grads)

    def register_local_var(self: Any, var: Any) -> None:
        """Horovod's: ``var``'s gradient is not reduced over the ranks; this rank's own is
        applied (divided by the number of ranks with ``scale_local_gradients``)."""
        from ddl.tensorflow.gradient_tape import var_key

        if getattr(self, "_ddl_local", None) is None:
            object.__setattr__(self, "_ddl_local", {})
        key = var_key(var) if _backend() == "tensorflow" else id(var)
        self._ddl_local[key] = var

    cls = type(base.__name__, (base,), {
        "_clip_gradients": _clip_gradients,
        "_backend_apply_gradients": _backend_apply_gradients,
        "register_local_var": register_local_var,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "_ddl_distributed": True,
        "__doc__": base.__doc__,
    })
    _CLASSES[base] = cls
    return cls


def is_distributed(optimizer: Any) -> bool:
    return bool(getattr(type(optimizer), "_ddl_distributed", False))


def _args(compression: type[Compressor], sparse_as_dense: bool, op: Any,
          gradient_predivide_factor: float, backward_passes_per_step: int,
          average_aggregated_gradients: bool, process_set: Any,
          scale_local_gradients: bool = True) -> dict:
    scope(process_set)  # this rank must be in it
    if op not in (ddl.Average, ddl.Sum):
        raise ddl.DDLConfigError(f"DistributedOptimizer: op must be Average or Sum, not {op}")
    if gradient_predivide_factor != 1.0 and op is not ddl.Average:
        raise ddl.DDLConfigError("gradient_predivide_factor needs op=Average")
    if int(backward_passes_per_step) < 1:
        raise ddl.DDLConfigError("backward_passes_per_step must be >= 1")
    steps = int(backward_passes_per_step)
    return dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                predivide=float(gradient_predivide_factor), process_set=process_set,
                scale_local=bool(scale_local_gradients),
                sum_steps=steps if steps > 1 and not average_aggregated_gradients else 1)


def distribute(optimizer: Any, args: dict) -> Any:
    """Turn ``optimizer`` itself into its distributed class (its state kept): what
    :func:`ddl.keras.load_model` does to a loaded model's optimizer."""
    _backend()
    base = type(optimizer).__mro__[1] if is_distributed(optimizer) else type(optimizer)
    optimizer.__class__ = _distributed_class(base)
    optimizer._ddl_args = args
    return optimizer


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
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ddl.DDLConfigError(
            f"DistributedOptimizer takes a Keras 3 optimizer, got {type(optimizer).__name__}")
    _backend()
    args = _args(compression, sparse_as_dense, op, gradient_predivide_factor,
                 backward_passes_per_step, average_aggregated_gradients, process_set,
                 scale_local_gradients)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = int(backward_passes_per_step)
    base = type(optimizer)
    if is_distributed(optimizer):
        base = base.__mro__[1]
    new = _distributed_class(base).from_config(config)
    new._ddl_args = args
    object.__setattr__(new, "_ddl_local", {})
    return new


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
