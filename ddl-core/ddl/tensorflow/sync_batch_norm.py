"""Horovod's ``hvd.SyncBatchNormalization`` for Keras 3 on TensorFlow: batch normalization
whose training statistics cover the batch of every rank, as if one rank had the whole
batch. The group mean is the ranks' means weighted by their element counts (Horovod
weights every rank the same: the same when the ranks' batches are equal, wrong when they
are not), and the variance is the ranks' squared deviations from it, summed (two small
allreduces; Horovod's one-pass E[x^2] - E[x]^2 loses the variance of data with a large
mean in float32). The gradient flows through the sums, so it is the whole batch's.
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
        # no fixed default name (Horovod gives one): Keras names the layers of one model
        # sync_batch_normalization, sync_batch_normalization_1, ...
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
        # Two passes over the ranks, as Keras's own moments take two over the batch: the
        # group mean first, then each rank's squared deviations from it (its own variance
        # plus its mean's offset, Chan's formula), so a large mean costs no precision.
        total = allreduce(tf.concat([count * mean, tf.reshape(count, [1])], axis=0), op=Sum)
        n = total[-1]
        group_mean = total[:-1] / n
        spread = allreduce(count * (variance + tf.square(mean - group_mean)), op=Sum)
        return (tf.reshape(group_mean, shape_of_mean),
                tf.reshape(spread / n, shape_of_mean))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "fused": False}


__all__ = ["SyncBatchNormalization"]
