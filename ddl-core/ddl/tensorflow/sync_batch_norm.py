"""Horovod's ``hvd.SyncBatchNormalization`` for Keras 3 on TensorFlow: batch normalization
whose training statistics cover the batch of every rank, as if one rank had the whole
batch. Each rank's mean and mean of squares are summed over the ranks weighted by its
element count (Horovod weights every rank the same, which is the same thing when the
ranks' batches are equal, and wrong when they are not), so uneven last batches are right
too. The gradient flows through the sum (an allreduce), so it is the whole batch's.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from ddl.hvd.basics import Sum, size

from .mpi_ops import allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with its training statistics taken over every
    rank's batch (Horovod's ``hvd.SyncBatchNormalization``). ``fused`` is Horovod's
    argument: only ``False`` is accepted (Keras 3 has no fused kernel at all); the rest are
    Keras's. At inference it is the plain layer (the moving statistics are the same on every
    rank)."""

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        mean, variance = super()._moments(inputs, mask)
        if size() == 1:
            return mean, variance
        dtype, shape_of_mean = mean.dtype, tf.shape(mean)
        if mask is None:
            shape = tf.shape(inputs)
            count = tf.cast(tf.reduce_prod(tf.gather(shape, self._reduction_axes)), dtype)
        else:  # Keras's masked moments: the mask covers every axis but the channels'
            count = tf.reduce_sum(tf.cast(mask, dtype))
        mean = tf.reshape(mean, [-1])
        variance = tf.reshape(variance, [-1])
        local = tf.concat([count * mean, count * (variance + tf.square(mean)),
                           tf.reshape(count, [1])], axis=0)
        total = allreduce(local, op=Sum)
        channels = tf.shape(mean)[0]
        n = total[-1]
        group_mean = total[:channels] / n
        group_variance = tf.maximum(total[channels:2 * channels] / n - tf.square(group_mean),
                                    0.0)
        return (tf.reshape(group_mean, shape_of_mean),
                tf.reshape(group_variance, shape_of_mean))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "fused": False}


__all__ = ["SyncBatchNormalization"]
