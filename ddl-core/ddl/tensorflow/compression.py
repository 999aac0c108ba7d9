"""Horovod's ``hvd.Compression`` for TensorFlow tensors: the compressor protocol of
:mod:`ddl.hvd.compression`, with the cast done by TensorFlow (so it is part of the graph
inside a ``tf.function``, and a user's own TF compressor works the same way)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ddl.hvd.compression import Compressor, NoneCompressor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 (half the bytes); others unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None or tensor.dtype == ctx else tf.cast(tensor, ctx)


class Compression:
    """``hvd.Compression.none`` / ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
