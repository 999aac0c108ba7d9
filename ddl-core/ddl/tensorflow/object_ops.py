"""Horovod's TensorFlow object collectives: ``broadcast_object`` and ``allgather_object``
over :mod:`ddl.hvd.objects`, with objects pickled by cloudpickle and TensorFlow tensors sent
as their numpy values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from ddl.hvd import objects as _objects
from ddl.hvd.process_sets import ProcessSet, global_process_set


class _CloudPickle:
    """Objects travel pickled with cloudpickle (lambdas and local classes included), as in
    Horovod's TensorFlow ``broadcast_object``; TensorFlow tensors as their numpy values."""

    @staticmethod
    def dumps(obj: Any) -> np.ndarray:
        import cloudpickle

        data = cloudpickle.dumps(_to_numpy(obj))
        return np.frombuffer(data, dtype=np.uint8).copy()

    @staticmethod
    def loads(data: np.ndarray) -> Any:
        import cloudpickle

        return cloudpickle.loads(data.tobytes())


def _to_numpy(obj: Any) -> Any:
    if isinstance(obj, (tf.Tensor, tf.Variable)):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every rank (eager; ``session`` is TF1's, not needed)."""
    return _objects.broadcast_object(obj, root_rank, name, process_set, pickler=_CloudPickle)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj``, in rank order (eager)."""
    return _objects.allgather_object(obj, name, process_set, pickler=_CloudPickle)


__all__ = ["allgather_object", "broadcast_object"]
