"""Gradient compression: Horovod's two-method strategy objects, same names and contract,
for torch tensors and numpy arrays alike (``ddl.tensorflow`` compresses the numpy view of
its tensors).

``compress(tensor) -> (tensor_to_send, ctx)`` and ``decompress(tensor, ctx) -> tensor``.
"""

from __future__ import annotations

from typing import Any

from .arrays import ops_for


class Compressor:
    """Interface: subclass and override both static methods. The two class attributes tell
    the fusion code what a compressor does without it knowing the class (a user's own
    compressor keeps the safe defaults)."""

    # compress() returns its input: gradients may be reduced where they live
    passthrough = False
    # compress() is at most a cast that a plain copy into a buffer of the wire dtype does
    # exactly (no temporary, no ctx beyond the dtype)
    cast_only = False

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


def passthrough(compression: Any) -> bool:
    return bool(getattr(compression, "passthrough", False))


def cast_only(compression: Any) -> bool:
    return bool(getattr(compression, "cast_only", False))


class NoneCompressor(Compressor):
    """Send gradients as they are."""

    passthrough = cast_only = True

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point gradients as float16 (half the bytes); others unchanged."""

    cast_only = True

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
