"""Elastic training with Keras 3 (``import ddl.keras as hvd``; ``hvd.elastic.run``,
``hvd.elastic.KerasState`` and the ``model.fit`` callbacks), Horovod's
``horovod.tensorflow.keras.elastic`` on every Keras backend. A script in Horovod's order::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(x, y, steps_per_epoch=steps, epochs=epochs - state.epoch,
                        callbacks=callbacks)

    train(state)

The shared part (the state, the callbacks, the loop) is :mod:`ddl.keras_elastic`.
"""

from __future__ import annotations

from typing import Any

import keras

from ddl.elastic import ObjectState, State
from ddl.errors import HorovodInternalError, HostsUpdatedInterrupt
from ddl.keras_elastic import (
    CommitStateCallback,
    TensorFlowKerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)


class KerasState(TensorFlowKerasState):
    """Horovod's ``KerasState``: a Keras model and its optimizer (``optimizer`` or the
    compiled one), plus plain values given as keyword arguments (``epoch=0, batch=0``);
    see :class:`ddl.keras_elastic.TensorFlowKerasState`."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("backend", keras.backend)
        super().__init__(model, optimizer=optimizer, **kwargs)


__all__ = ["CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt",
           "KerasState", "ObjectState", "State", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]
