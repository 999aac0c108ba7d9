"""Horovod's Keras ``DistributedOptimizer`` for Keras 3 (TensorFlow and torch backends), the
part :mod:`ddl.keras` and :mod:`ddl.tensorflow` share (Horovod's ``horovod/_keras``):
``hvd.DistributedOptimizer`` of either adapter, given a Keras optimizer, makes it here.

The wrapper is a subclass of the optimizer's own class, made on the fly, that keeps the
class's name and module (a saved ``.keras`` model then loads with or without ddl) and
overrides one step of Keras's ``apply``: the gradients are reduced over every rank (one
grouped call, fused per dtype) right before Keras clips them, on update steps only. So
``clipnorm`` sees the averaged gradients as in Horovod, and with
``backward_passes_per_step=N`` (Keras's own ``gradient_accumulation_steps``) gradients are
accumulated locally and travel once every N steps.

How the gradients are reduced depends on the Keras backend, and is a :class:`Reduction`
the adapter passes in: ``ddl.tensorflow``'s TF ops (which run inside a ``tf.function``
train step) on the tensorflow backend, :data:`TORCH` (the framework-free collectives on the
torch tensors) on the torch backend. This module imports neither adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras

import ddl
from ddl.hvd import collectives as C
from ddl.hvd.compression import Compressor
from ddl.hvd.process_sets import scope

_CLASSES: dict[type, type] = {}
_BACKENDS = ("tensorflow", "torch")


@dataclass(frozen=True)
class Reduction:
    """A backend's two steps: ``reduce(grads, args, variables, local)`` returns the
    gradients reduced over the ranks (those of ``local``'s variables, keyed by ``key``,
    kept as this rank's own); ``key(variable)`` is a variable's identity."""

    reduce: Callable[[list[Any], dict, list[Any], dict], list[Any]]
    key: Callable[[Any], int]


def _reduce_torch(grads: list[Any], args: dict, variables: list[Any], local: dict
                  ) -> list[Any]:
    is_local = [id(v) in local for v in variables] if local else [False] * len(grads)
    at = [i for i, g in enumerate(grads) if g is not None and not is_local[i]]
    pre, post, op = 1.0, 1.0, args["op"]
    if args["predivide"] != 1.0:
        n = scope(args["process_set"]).size
        pre, post, op = 1.0 / args["predivide"], args["predivide"] / n, ddl.Sum
    reduced = C.grouped_allreduce([grads[i] for i in at], op=op,
                                  compression=args["compression"], prescale=pre,
                                  postscale=post, process_set=args["process_set"])
    out = list(grads)
    for i, r in zip(at, reduced):
        out[i] = r
    if args["scale_local"]:
        n = scope(args["process_set"]).size
        out = [g / n if loc and g is not None else g for g, loc in zip(out, is_local)]
    return out


TORCH = Reduction(reduce=_reduce_torch, key=id)
"""The torch backend's reduction: Keras's gradients are torch tensors outside autograd."""


def backend() -> str:
    """Keras's backend, when ddl supports it."""
    name = keras.backend.backend()
    if name not in _BACKENDS:
        raise NotImplementedError(
            f"ddl.keras supports the tensorflow and torch backends of Keras 3, not {name!r} "
            "(set KERAS_BACKEND=tensorflow or torch)")
    return name


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
            grads = args["reduction"].reduce(grads, args, variables or [None] * len(grads),
                                             local)
        if args["sum_steps"] != 1:
            # Keras averages the accumulated steps; Horovod's default is their sum.
            grads = [None if g is None else g * args["sum_steps"] for g in grads]
        return base._clip_gradients(self, grads)

    def register_local_var(self: Any, var: Any) -> None:
        """Horovod's: ``var``'s gradient is not reduced over the ranks; this rank's own is
        applied (divided by the number of ranks with ``scale_local_gradients``)."""
        if getattr(self, "_ddl_local", None) is None:
            object.__setattr__(self, "_ddl_local", {})
        self._ddl_local[self._ddl_args["reduction"].key(var)] = var

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


def optimizer_args(compression: type[Compressor], sparse_as_dense: bool, op: Any,
                   gradient_predivide_factor: float, backward_passes_per_step: int,
                   average_aggregated_gradients: bool, process_set: Any,
                   scale_local_gradients: bool = True, *, reduction: Reduction) -> dict:
    """The checked settings a distributed optimizer keeps (its ``_ddl_args``)."""
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
                scale_local=bool(scale_local_gradients), reduction=reduction,
                sum_steps=steps if steps > 1 and not average_aggregated_gradients else 1)


def distribute(optimizer: Any, args: dict) -> Any:
    """Turn ``optimizer`` itself into its distributed class (its state kept): what
    :func:`ddl.keras.load_model` does to a loaded model's optimizer."""
    backend()
    base = type(optimizer).__mro__[1] if is_distributed(optimizer) else type(optimizer)
    optimizer.__class__ = _distributed_class(base)
    optimizer._ddl_args = args
    return optimizer


def is_keras_optimizer(optimizer: Any) -> bool:
    return isinstance(optimizer, keras.optimizers.Optimizer)


def check_optimizer(optimizer: Any) -> None:
    """What every DistributedOptimizer checks first: a Keras 3 optimizer, on a backend
    ddl supports."""
    if not is_keras_optimizer(optimizer):
        raise ddl.DDLConfigError(
            f"DistributedOptimizer takes a Keras 3 optimizer, got {type(optimizer).__name__}")
    backend()


def distributed_optimizer(optimizer: keras.optimizers.Optimizer, args: dict,
                          name: str | None, backward_passes_per_step: int
                          ) -> keras.optimizers.Optimizer:
    """A new optimizer of ``optimizer``'s class and config (named ``name`` when given)
    that reduces its gradients as ``args`` (:func:`optimizer_args`) say."""
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


def local_layer_variables(local_layers: Any) -> list[Any]:
    """The trainable variables of ``local_layers`` (one Keras layer or several), as
    Horovod's ``Partial*`` wrappers take them; ``ValueError`` for anything but layers."""
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return [v for layer in local_layers for v in layer.trainable_weights]
