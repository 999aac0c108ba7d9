"""The few array operations the Horovod-level layer needs, for each kind of array it is
given: numpy arrays (what ``ddl.tensorflow`` hands over from inside ``tf.numpy_function``
and from eager tensors) and torch tensors (``ddl.torch``).

Everything else (the identity exchange, scaling rules, fusion, join) is written once over
these. torch is never imported here: a torch tensor is recognised only when the caller has
imported torch already, as in :mod:`ddl.tensors`.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import dtypes as _dtypes
from .. import tensors as _tensors


class NumpyOps:
    """numpy arrays, bfloat16 included when ``ml_dtypes`` (shipped with TensorFlow and JAX)
    provides the type."""

    name = "numpy"

    @staticmethod
    def integer(t: np.ndarray) -> bool:
        return t.dtype.kind in "iu"

    @staticmethod
    def floating(t: np.ndarray) -> bool:
        return t.dtype.kind == "f" or t.dtype.name == "bfloat16"

    @staticmethod
    def scaled(t: np.ndarray, factor: float) -> np.ndarray:
        """``factor * t`` as Horovod's ScaleBuffer (CPU) computes it: an integer array is
        multiplied in float64 and cast back (truncated toward zero), never promoted; a
        16-bit float one (float16, bfloat16) element by element in float32, by the factor
        as a float32, rounded back once (numpy alone would round the factor to 16 bits
        first: one unit in the last place off for some elements); float32 by the factor
        as a float32, float64 by the factor itself."""
        if NumpyOps.integer(t):
            return (t.astype(np.float64) * factor).astype(t.dtype)
        if t.dtype.itemsize == 2:
            return (t.astype(np.float32) * np.float32(factor)).astype(t.dtype)
        return (t * factor).astype(t.dtype, copy=False)

    @staticmethod
    def scale_(t: np.ndarray, factor: float) -> None:
        """:meth:`scaled`, into ``t``."""
        if NumpyOps.integer(t):
            np.copyto(t, t.astype(np.float64) * factor, casting="unsafe")
        elif t.dtype.itemsize == 2:
            np.copyto(t, t.astype(np.float32) * np.float32(factor), casting="unsafe")
        else:
            np.copyto(t, t * factor, casting="unsafe")

    @staticmethod
    def copy_(dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src, casting="unsafe")

    @staticmethod
    def flat_cat(ts: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate([np.ascontiguousarray(t).reshape(-1) for t in ts])

    @staticmethod
    def cat(ts: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate(list(ts))

    @staticmethod
    def numel(t: np.ndarray) -> int:
        return int(t.size)

    @staticmethod
    def ndim(t: np.ndarray) -> int:
        return t.ndim

    @staticmethod
    def reshape(t: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        return t.reshape(tuple(shape))

    @staticmethod
    def device(t: Any) -> int:
        return 0

    @staticmethod
    def astype(t: np.ndarray, dtype: Any) -> np.ndarray:
        return t.astype(dtype)

    @staticmethod
    def float16() -> Any:
        return np.dtype(np.float16)

    @staticmethod
    def dtype(t: np.ndarray) -> Any:
        return t.dtype

    @staticmethod
    def counts(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.int64)

    @staticmethod
    def rows(t: Any) -> list[int]:
        return [int(x) for x in (t.tolist() if hasattr(t, "tolist") else t)]

    @staticmethod
    def no_grad() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def dumps(obj: Any) -> np.ndarray:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return np.frombuffer(data, dtype=np.uint8).copy()

    @staticmethod
    def loads(data: np.ndarray) -> Any:
        return pickle.loads(data.tobytes())


class TorchOps:
    """torch tensors, on any device (the core stages device tensors through host memory
    or hands them to the device engine)."""

    name = "torch"

    @staticmethod
    def integer(t: Any) -> bool:
        return not (t.is_floating_point() or t.is_complex() or t.dtype == _torch().bool)

    @staticmethod
    def floating(t: Any) -> bool:
        return t.is_floating_point()

    @staticmethod
    def scaled(t: Any, factor: float) -> Any:
        """As :meth:`NumpyOps.scaled`. torch multiplies a float16 or bfloat16 tensor by a
        Python scalar in float32 already (its "opmath" type, the scalar converted once, on
        the CPU and CUDA alike): Horovod's ScaleBuffer, bit for bit, with no copy."""
        if TorchOps.integer(t):
            return (t.to(_torch().float64) * factor).to(t.dtype)
        return t * factor

    @staticmethod
    def scale_(t: Any, factor: float) -> None:
        with torch_writes(t):
            if TorchOps.integer(t):
                t.copy_(t.to(_torch().float64).mul_(factor))
            else:
                t.mul_(factor)

    @staticmethod
    def copy_(dst: Any, src: Any) -> None:
        with torch_writes(dst):
            dst.copy_(src)

    @staticmethod
    def flat_cat(ts: Sequence[Any]) -> Any:
        return _torch().cat([t.reshape(-1) for t in ts])

    @staticmethod
    def cat(ts: Sequence[Any]) -> Any:
        return _torch().cat(list(ts))

    @staticmethod
    def numel(t: Any) -> int:
        return t.numel()

    @staticmethod
    def ndim(t: Any) -> int:
        return t.dim()

    @staticmethod
    def reshape(t: Any, shape: Sequence[int]) -> Any:
        return t.reshape(tuple(shape))

    @staticmethod
    def device(t: Any) -> int:
        dev = t.device
        return 0 if dev.type in ("cpu", "meta") else 1 + (dev.index or 0)

    @staticmethod
    def astype(t: Any, dtype: Any) -> Any:
        return t.to(dtype)

    @staticmethod
    def float16() -> Any:
        return _torch().float16

    @staticmethod
    def dtype(t: Any) -> Any:
        return t.dtype

    @staticmethod
    def counts(a: np.ndarray) -> Any:
        return _torch().from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    @staticmethod
    def rows(t: Any) -> list[int]:
        return [int(x) for x in (t.tolist() if hasattr(t, "tolist") else t)]

    @staticmethod
    def no_grad() -> contextlib.AbstractContextManager:
        return _torch().no_grad()

    @staticmethod
    def dumps(obj: Any) -> np.ndarray:
        # torch.save keeps tensors' devices and storages shared between them, as Horovod's
        # torch broadcast_object does.
        buf = io.BytesIO()
        _torch().save(obj, buf)
        return np.frombuffer(buf.getbuffer(), dtype=np.uint8).copy()

    @staticmethod
    def loads(data: np.ndarray) -> Any:
        return _torch().load(io.BytesIO(data.tobytes()), weights_only=False)


def _torch() -> Any:
    return sys.modules["torch"]


def torch_writes(*ts: Any) -> contextlib.AbstractContextManager:
    """The mode for in-place updates of the caller's tensors ``ts``: ``no_grad``, or
    ``inference_mode`` when one of them is an inference tensor, which may be updated in
    place only inside it. The caller's own mode does not reach the thread that finishes
    the work (ddl's worker): PyTorch Lightning reduces with ``sync_dist=True`` from
    validation, under ``torch.inference_mode()``."""
    torch = _torch()
    for t in ts:
        if t.is_inference():
            return torch.inference_mode()
    return torch.no_grad()


def ops_for(x: Any) -> type[NumpyOps] | type[TorchOps]:
    """The operations for ``x``'s kind of array (numpy for anything that is not a torch
    tensor: the core's own conversion then says what it cannot take)."""
    return TorchOps if _tensors.is_torch(x) else NumpyOps


def zeros(code: int, shape: tuple[int, ...]) -> Any:
    """Zeros of ddl dtype ``code``: what a joined rank contributes. numpy has no bfloat16,
    so that one comes from ``ml_dtypes`` when installed, else from torch when imported."""
    dt = _dtypes.BY_CODE[code]
    if dt is _dtypes.BFLOAT16:
        bf16 = _dtypes.numpy_bfloat16()
        if bf16 is not None:
            return np.zeros(shape, dtype=bf16)
        torch = sys.modules.get("torch")
        if torch is None:
            raise _dtypes.DDLConfigError("bfloat16 needs ml_dtypes or torch installed")
        return torch.zeros(shape, dtype=torch.bfloat16)
    return np.zeros(shape, dtype=dt.storage)
