"""Elastic training with TensorFlow 2 (``import ddl.tensorflow as hvd``;
``hvd.elastic.run``, ``hvd.elastic.TensorFlowKerasState``, ``hvd.elastic.TensorFlowState``):
Horovod's ``horovod.tensorflow.elastic`` on :mod:`ddl.elastic`. The loop and the Keras
model state are :mod:`ddl.keras_elastic`'s, shared with :mod:`ddl.keras`; this module adds
the state of plain ``tf.Variable``s. Eager only: TF1 sessions are not supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ddl.elastic import ObjectState, State
from ddl.errors import DDLConfigError, HorovodInternalError, HostsUpdatedInterrupt
from ddl.keras_elastic import TensorFlowKerasState, VariablesState, run


class TensorFlowState(VariablesState):
    """Horovod's ``TensorFlowState``: a list of ``tf.Variable``s plus plain values given
    as keyword arguments (``epoch=0``), kept as attributes. TensorFlow 2 keeps no global
    collection of variables, so ``variables`` is required; ``session`` (TF1) is refused."""

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        if session is not None or not tf.executing_eagerly():
            raise DDLConfigError("TensorFlowState: TF1 sessions and graph mode are not "
                                 "supported; use TensorFlow 2 eager execution")
        if not variables:
            raise DDLConfigError("TensorFlowState(variables=[...]): pass the tf.Variables "
                                 "to keep (TensorFlow 2 has no global variables)")
        self.variables = list(variables)
        self.session = None
        super().__init__(lambda: self.variables, **kwargs)

    def _read(self) -> list[np.ndarray]:
        return [np.array(v.numpy(), copy=True) for v in self.variables]


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "run"]
