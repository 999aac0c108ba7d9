"""Gradient compression: Horovod's two-method strategy objects, same names and contract,
for torch tensors and numpy arrays alike (``ddl.tensorflow`` compresses the numpy view of
its tensors).

``compress(tensor) -> (tensor_to_send, ctx)`` and ``decompress(tensor, ctx) -> tensor``.
"""

from __future__ import annotations

from typing import Any

from .arrays import ops_for


class Compressor:
    """Interface: subclass and override both static methods."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send gradients as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point gradients as float16 (half the bytes); others unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        fw = ops_for(tensor)
        dtype, half = fw.dtype(tensor), fw.float16()
        if fw.floating(tensor) and dtype != half:
            return fw.astype(tensor, half), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        fw = ops_for(tensor)
        return tensor if ctx is None or fw.dtype(tensor) == ctx else fw.astype(tensor, ctx)


class Compression:
    """``hvd.Compression.none`` / ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
