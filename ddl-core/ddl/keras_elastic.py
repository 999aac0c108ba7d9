"""Elastic training for Keras 3 models, the part :mod:`ddl.tensorflow` and :mod:`ddl.keras`
share (Horovod's ``horovod/_keras/elastic.py`` and ``TensorFlowKerasState``): the state of a
model and its optimizer, the state of plain variables, the elastic loop that takes a
framework's error caused by a lost peer for Horovod's ``HorovodInternalError``, and the
``model.fit`` callbacks. Every Keras backend (tensorflow, torch): values travel as numpy
through the framework-free core, as in :mod:`ddl.keras.variables`. This module imports
neither adapter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import keras
import numpy as np

from ddl import elastic as _elastic
from ddl import failures
from ddl.errors import DDLConfigError, HorovodInternalError
from ddl.hvd import collectives as C

F = TypeVar("F", bound=Callable[..., Any])


def run(func: F) -> F:
    """Horovod's ``hvd.elastic.run`` for TensorFlow and Keras: :func:`ddl.elastic.run`,
    where an error that a lost peer caused, but that the framework re-raised as its own
    (TensorFlow turns an op's Python error into a ``tf.errors.OpError`` that carries ddl's
    message on), is raised as ``HorovodInternalError`` (the original as its cause), so
    the last commit is restored."""

    @functools.wraps(func)
    def as_internal(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except HorovodInternalError:
            raise
        except Exception as exc:
            if failures.after_peer(exc):
                raise HorovodInternalError(f"a collective failed because a peer was lost: "
                                           f"{failures.reason(exc)}") from exc
            raise

    return _elastic.run_fn(as_internal, _elastic.reset)  # type: ignore[return-value]


class VariablesState(_elastic.ObjectState):
    """State of a list of variables (what ``variables()`` gives, asked each time) plus
    plain values: ``save`` copies their values to host memory as numpy, ``restore``
    assigns the copies back, ``sync`` gives every rank rank 0's values (one grouped
    broadcast of the copies, then the assignment) and the plain values."""

    def __init__(self, variables: Callable[[], Sequence[Any]], **kwargs: Any) -> None:
        self._variables = variables
        self._values = self._read()
        super().__init__(**kwargs)

    def save(self) -> None:
        self._values = self._read()
        super().save()

    def restore(self) -> None:
        self._assign()
        super().restore()

    def sync(self) -> None:
        values = self._read()
        C.broadcast_group_(lambda: values, 0, what="elastic state sync")
        self._values = values
        self._assign()
        super().sync()

    def _read(self) -> list[np.ndarray]:
        return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in self._variables()]

    def _assign(self) -> None:
        variables = list(self._variables())
        if len(variables) != len(self._values):
            # the optimizer made variables after the state was saved: say so rather
            # than assign values to the wrong variables
            raise DDLConfigError(f"elastic state: {len(variables)} variables now, "
                                 f"{len(self._values)} when saved; build the model and the "
                                 "optimizer before making the state")
        for variable, value in zip(variables, self._values):
            variable.assign(value)


class TensorFlowKerasState(VariablesState):
    """Horovod's ``TensorFlowKerasState``: a Keras 3 model's variables and its optimizer's
    (``optimizer`` or the model's compiled one), plus plain values given as keyword
    arguments (``epoch=0, batch=0``), kept as attributes. The model must be built; an
    optimizer that has no variables yet is built for the model's trainable variables (its
    slots start at zero, as a first step would make them), so every rank, new ones too,
    holds the same variables. ``backend`` is Horovod's TF1 session source, unused in
    Keras 3 (kept for scripts that pass it).

    The optimizer's gradient accumulators (``backward_passes_per_step``) are saved and
    restored too, but not synchronised: they hold each rank's own gradients."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise DDLConfigError("elastic state: the model is not built; call "
                                 "model.build(input_shape) (or train one step) first")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        self.backend = backend
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        super().__init__(self._model_variables, **kwargs)

    def _model_variables(self) -> list[Any]:
        opt = self.optimizer
        return list(self.model.variables) + (list(opt.variables) if opt is not None else [])

    def sync(self) -> None:
        own = list(getattr(self.optimizer, "_accumulated_gradients", None) or ())
        kept = [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in own]
        super().sync()
        for variable, value in zip(own, kept):
            variable.assign(value)  # this rank's own gradients again, not rank 0's
        if own:
            self._values = self._read()


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of every
    epoch (Horovod's). Place it after the callbacks that update the state
    (``UpdateEpochStateCallback``, ``UpdateBatchStateCallback``), as Horovod's examples
    do, so that a commit holds the batch and epoch just finished."""

    def __init__(self, state: _elastic.State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise DDLConfigError(f"CommitStateCallback: batches_per_commit="
                                 f"{batches_per_commit}; it must be 1 or more")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        # every rank counts from here after a reset, so they commit at the same batches
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.batches_remaining = self.batches_per_commit
            self.state.commit()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` the number of batches of the current epoch done (0 again at
    the epoch's end). After a restart in the middle of an epoch whose length is known
    (``steps_per_epoch``, or a dataset of known size), the first epoch runs only the
    batches not yet done, as Horovod's: Keras 3 reads no change of ``params['steps']``,
    so the epoch is ended early with ``model.stop_training``, cleared again at the
    epoch's end. A restart that came after an epoch's last batch but before its end
    runs one batch more (Keras cannot start an epoch with no step)."""

    def __init__(self, state: _elastic.State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None
        self._done = 0  # batches of this epoch done before this fit began
        self._stop_after: int | None = None
        self._stopped = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        steps = self.params.get("steps")
        self._done, self._stop_after = 0, None
        if not steps:
            return  # the epoch's length is unknown: it runs whole, counted from 0
        if self.steps_per_epoch is None:
            self.steps_per_epoch = steps
        self._done = min(self.state.batch, self.steps_per_epoch)
        remaining = max(self.steps_per_epoch - self._done, 1)
        self.params["steps"] = remaining  # what the progress bar shows
        if self._done:
            self._stop_after = remaining

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = self._done + batch + 1
        if self._stop_after is not None and batch + 1 >= self._stop_after:
            self.model.stop_training = True
            self._stopped = True

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0
        self._done, self._stop_after = 0, None
        if self._stopped:
            self.model.stop_training = False
            self._stopped = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` the number of epochs done over the whole job: Keras counts the
    epochs of each ``fit`` from 0 (or ``initial_epoch``), so the state's epoch when
    training (re)started is added, as Horovod's. Train with ``epochs=total -
    state.epoch``."""

    def __init__(self, state: _elastic.State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["CommitStateCallback", "TensorFlowKerasState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "VariablesState", "run"]
