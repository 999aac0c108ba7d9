"""Horovod's TensorFlow value ops: ``rank_op``, ``size_op`` and kin, int32 scalars read when
the op runs (not when it is built), and Horovod's process-set error codes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

import ddl
from ddl.hvd import process_sets as _ps
from ddl.hvd.process_sets import ProcessSet

# Horovod's process-set error codes (horovod/common/common.h), returned by
# process_set_included_op as Horovod's does.
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _value_op(value: Callable[[], int], default_name: str, name: str | None) -> tf.Tensor:
    """An int32 scalar op whose value is read when it runs, not when it is built (a
    stateful ``numpy_function`` in a graph or ``tf.function``; a constant eagerly), as
    Horovod's ``rank_op`` and kin. Not differentiable."""
    if tf.executing_eagerly():
        return tf.constant(value(), dtype=tf.int32)
    out = tf.numpy_function(lambda: np.asarray(value(), dtype=np.int32), [], tf.int32,
                            stateful=True, name=name or default_name)
    out = tf.stop_gradient(out)
    out.set_shape([])
    return out


def _set_of(process_set_id: int) -> ProcessSet | None:
    return _ps.by_id(process_set_id)


def _set_size(process_set_id: int) -> int:
    ps = _set_of(process_set_id)
    if ps is None:
        raise ddl.DDLConfigError(f"size_op: no process set with id {process_set_id}")
    return ps.size()


def _included(process_set_id: int) -> int:
    if not ddl.is_initialized():
        return PROCESS_SET_ERROR_INIT
    ps = _set_of(process_set_id)
    if ps is None:
        return PROCESS_SET_ERROR_UNKNOWN_SET
    return int(ps.included())


def rank_op(name: str | None = None) -> tf.Tensor:
    """Horovod's ``rank_op``: this process's rank, as an int32 scalar op evaluated when
    it runs."""
    return _value_op(ddl.rank, "HorovodRank", name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """Horovod's ``local_rank_op``: this process's rank on its host, as an op."""
    return _value_op(ddl.local_rank, "HorovodLocalRank", name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """Horovod's ``size_op``: the number of processes of the process set with id
    ``process_set_id`` (0: every process), as an op."""
    return _value_op(lambda: _set_size(process_set_id), "HorovodSize", name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """Horovod's ``local_size_op``: the number of processes on this host, as an op."""
    return _value_op(ddl.local_size, "HorovodLocalSize", name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """Horovod's ``process_set_included_op``: 1 when this process is in the process set
    with id ``process_set_id``, 0 when it is not; -1 before ``init()``, -3 for an unknown
    id (Horovod's error codes)."""
    return _value_op(lambda: _included(process_set_id), "HorovodProcessSetIncluded", name)


__all__ = ["PROCESS_SET_ERROR_INIT", "PROCESS_SET_ERROR_UNKNOWN_SET", "local_rank_op",
           "local_size_op", "process_set_included_op", "rank_op", "size_op"]
