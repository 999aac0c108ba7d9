"""Horovod's Keras callbacks for Keras 3 (``import ddl.keras as hvd``;
``hvd.callbacks.BroadcastGlobalVariablesCallback(0)`` and the others).

Checkpoints: save on rank 0 only (``if hvd.rank() == 0: callbacks.append(
keras.callbacks.ModelCheckpoint(...))``): every rank holds the same weights, and ranks
writing one file at once corrupt it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

import ddl
from ddl.hvd import collectives as C

from .variables import broadcast_variables, model_variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from ``root_rank``'s state: the model's variables at the start of
    training (when the model is built), and the model's and the optimizer's after the
    first batch (Keras creates optimizer variables in the first step), as Horovod's.
    ``local_variables`` (a variable or several) are left alone: each rank keeps its own."""

    def __init__(self, root_rank: int = 0, device: str = "",
                 local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local_vars: dict[int, Any] = {}
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        elif not all(_is_variable(v) for v in local_variables):
            raise ValueError("All local variables must be of tf.Variable type.")
        for v in local_variables:
            self.register_local_var(v)

    def register_local_var(self, var: Any) -> None:
        """``var`` is not broadcast: each rank keeps its own value."""
        self._local_vars[_key(var)] = var

    def _shared(self, variables: list) -> list:
        return [v for v in variables if _key(v) not in self._local_vars]

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.model.built:
            broadcast_variables(self._shared(self.model.variables), self.root_rank)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.broadcast_done:
            return
        broadcast_variables(self._shared(model_variables(self.model)), self.root_rank)
        self.broadcast_done = True


def _is_variable(v: Any) -> bool:
    if isinstance(v, keras.Variable):
        return True
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(v, tf.Variable)


def _key(v: Any) -> int:
    """A Keras 3 variable and the backend variable it holds count as one."""
    inner = getattr(v, "_value", None)
    return id(inner) if isinstance(v, keras.Variable) and inner is not None and \
        type(inner).__name__.endswith("Variable") else id(v)


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics over every rank (put it before the callbacks that read
    them: ReduceLROnPlateau, EarlyStopping, TensorBoard, ModelCheckpoint...)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = [np.asarray([float(logs[k])], dtype=np.float64) for k in names]
        averaged = C.grouped_allreduce(values, op=ddl.Average, name=None)
        for k, v in zip(names, averaged):
            logs[k] = float(v[0])


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """``lr = initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``
    (exclusive), at each epoch's start with ``staircase``, else at each batch with the
    fractional epoch. ``multiplier`` may be a number. ``momentum_correction`` is accepted
    but does nothing: Keras 3 bakes ``momentum`` into the compiled step (docs say so)."""

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.steps_per_epoch, self.verbose = staircase, steps_per_epoch, verbose
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.current_epoch = 0

    def _active(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or
                                              epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.initial_lr * float(self.multiplier(epoch))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if self.staircase and self._active(epoch):
            self._set(epoch)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.staircase:
            return
        if not self.steps_per_epoch:
            raise ddl.DDLConfigError(
                "LearningRateScheduleCallback(staircase=False) needs steps_per_epoch "
                "(fit did not say how many steps an epoch has)")
        epoch = self.current_epoch + float(batch) / self.steps_per_epoch
        if self._active(epoch):
            self._set(epoch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warmup ("Accurate, Large Minibatch SGD", 2017): the learning
    rate rises linearly, at every batch, from ``initial_lr / size()`` to ``initial_lr``
    over ``warmup_epochs``; ``initial_lr`` is the already scaled rate (``base_lr *
    size()``)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            n = ddl.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == self.warmup_epochs - 1:
            # The last batch of warmup set the rate just below the target: finish there.
            self.model.optimizer.learning_rate = self.initial_lr
            if self.verbose and ddl.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                      f"{self.initial_lr:g}.")
        super().on_epoch_end(epoch, logs)


__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]
