"""Turn the tensors users pass (numpy arrays, torch tensors) into flat numpy views the
engines can move, without copying when the memory allows, and back.

The core never imports a framework: torch is recognised only when the caller already
imported it.
"""

from __future__ import annotations

import bisect
import sys
from typing import Any

import numpy as np

from . import dtypes
from .dtypes import DType
from .errors import DDLConfigError


class Flat:
    """A 1-D view of a tensor's elements plus what is needed to give results back."""

    __slots__ = ("array", "dtype", "shape", "original", "kind", "staged")

    def __init__(self, array: np.ndarray, dtype: DType, shape: tuple[int, ...], original: Any,
                 kind: str, staged: bool):
        self.array = array  # 1-D, C-contiguous, storage dtype
        self.dtype = dtype
        self.shape = shape
        self.original = original
        self.kind = kind  # "numpy" | "torch"
        self.staged = staged  # array is a private copy (non-contiguous or device tensor)

    def write_back(self) -> None:
        """Make an in-place result visible in the original when we had to stage a copy."""
        if not self.staged:
            return
        if self.kind == "numpy":
            self.original[...] = self.array.view(self.original.dtype).reshape(self.shape)
        else:
            _torch_write_back(self.original, self.array, self.dtype, self.shape)


def _torch():
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def flatten(x: Any, *, name: str = "tensor") -> Flat:
    if isinstance(x, np.ndarray):
        dt = dtypes.from_numpy(x.dtype)
        contiguous = x.flags.c_contiguous
        if contiguous:
            a = x if x.ndim == 1 else x.reshape(-1)
        else:
            a = np.ascontiguousarray(x).reshape(-1)
        if dt is dtypes.BFLOAT16:
            a = a.view(np.uint16)
        return Flat(a, dt, x.shape, x, "numpy", not contiguous)
    if is_torch(x):
        return _flatten_torch(x)
    if isinstance(x, (np.generic, int, float, bool, complex)):
        raise DDLConfigError(
            f"{name} is a scalar; pass an array (np.asarray(value) or torch.tensor(value))"
        )
    raise DDLConfigError(
        f"{name} has unsupported type {type(x).__module__}.{type(x).__name__}: "
        "ddl collectives take numpy arrays or torch tensors"
    )


def writable(flat: Flat, what: str, name: str = "tensor") -> Flat:
    """``flat`` when a collective may write its result there. A read-only numpy array
    (``writeable=False``: ``np.frombuffer`` of bytes, a broadcast view) is refused while the
    call is planned, before any data moves: the write would fail only after the peers'
    data arrived, leaving the engine out of step."""
    if flat.kind == "numpy" and not flat.original.flags.writeable:
        raise DDLConfigError(
            f"{what}: {name} is a read-only numpy array (writeable=False), so the result "
            f"cannot be written there: pass a writable array (np.array(x) copies it)"
            + ("" if name == "out" else " or call the out-of-place variant")
        )
    return flat


def dtype_of(t) -> DType:
    """The ddl dtype of a torch tensor."""
    return _torch_dtype(t)


_TORCH_DTYPES: dict[Any, DType] = {}  # torch dtype -> ours, filled as they are met


def _torch_dtype(t) -> DType:
    d = _TORCH_DTYPES.get(t.dtype)  # str(dtype) and its parsing: 0.3 us a call
    if d is not None:
        return d
    torch = _torch()
    if t.dtype == torch.bfloat16:
        d = dtypes.BFLOAT16
    else:
        name = str(t.dtype).removeprefix("torch.")
        d = dtypes.BY_NAME.get(name)
        if d is None:
            raise DDLConfigError(f"torch dtype {t.dtype} is not supported by ddl collectives")
    _TORCH_DTYPES[t.dtype] = d
    return d


def _torch_as_numpy(t, dt: DType) -> np.ndarray:
    torch = _torch()
    if dt is dtypes.BFLOAT16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _flatten_torch(x) -> Flat:
    # On the hot path (a contiguous CPU tensor, every small allreduce of a torch program)
    # each look-up counts: detach only what autograd tracks (numpy() refuses it), is_cpu
    # rather than device.type, no reshape of what is 1-D (2.7 -> 1.5 us a tensor).
    dt = _torch_dtype(x)
    t = x.detach() if x.requires_grad else x
    staged = False
    if not t.is_cpu:
        # GPU tensors go through host memory on the CPU engines.
        t = t.to("cpu").contiguous()
        staged = True
    elif not t.is_contiguous():
        t = t.contiguous()
        staged = True
    arr = _torch_as_numpy(t, dt)
    if t.dim() != 1:
        arr = arr.reshape(-1)
    return Flat(arr, dt, tuple(x.shape), x, "torch", staged)


def _torch_write_back(orig, arr: np.ndarray, dt: DType, shape) -> None:
    torch = _torch()
    src = torch.from_numpy(arr.reshape(shape))
    if dt is dtypes.BFLOAT16:
        src = src.view(torch.bfloat16)
    with torch.no_grad():
        orig.copy_(src)


def empty_like(flat: Flat, shape: tuple[int, ...] | None = None) -> tuple[Any, Flat]:
    """A new tensor of the same kind/dtype/device as ``flat.original`` and its flat view."""
    shape = flat.shape if shape is None else tuple(shape)
    if flat.kind == "numpy":
        out = np.empty(shape, dtype=flat.original.dtype)
        return out, Flat(out.reshape(-1).view(flat.dtype.storage), flat.dtype, shape, out,
                         "numpy", False)
    torch = _torch()
    orig = flat.original
    out = torch.empty(shape, dtype=orig.dtype, device="cpu")
    f = Flat(_torch_as_numpy(out, flat.dtype).reshape(-1), flat.dtype, shape, out, "torch", False)
    if orig.device.type != "cpu":
        dev = torch.empty(shape, dtype=orig.dtype, device=orig.device)
        f = Flat(f.array, flat.dtype, shape, dev, "torch", True)
        return dev, f
    return out, f


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    # may_share_memory (bounds only) first: __array_interface__ builds a dict (~0.8 us)
    if a.flags.owndata and b.flags.owndata:
        return a is b and a.size > 0  # as in overlaps
    return (a.size > 0 and np.may_share_memory(a, b)
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    if a.flags.owndata and b.flags.owndata:
        # two arrays that each own their memory share none unless they are one array
        # (the common out= call: 80 ns against np.shares_memory's 240)
        return a is b and a.size > 0
    return np.shares_memory(a, b) if a.size and b.size else False


class Pieces:
    """Several 1-D arrays of one dtype read as their concatenation: the source of a fused
    allreduce whose fusion buffer is never filled (the engine stages each piece straight
    from where it lives). Slices never cross the pieces returned by ``cuts``."""

    __slots__ = ("arrays", "starts", "size", "nbytes")

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.starts = [0]
        for a in arrays:
            self.starts.append(self.starts[-1] + a.size)
        self.size = self.starts[-1]
        self.nbytes = sum(a.nbytes for a in arrays)

    def cuts(self, lo: int, hi: int) -> list[tuple[int, int, np.ndarray]]:
        """``(start, end, view)`` for the parts of elements ``[lo, hi)`` in each piece."""
        out = []
        k = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi:
            a, s = self.arrays[k], self.starts[k]
            e = min(hi, s + a.size)
            if e > lo:
                out.append((lo, e, a[lo - s : e - s]))
            lo = max(lo, e)
            k += 1
        return out

    def copy_to(self, lo: int, hi: int, out: np.ndarray) -> None:
        """``out[:] = self[lo:hi]``."""
        for s, e, v in self.cuts(lo, hi):
            np.copyto(out[s - lo : e - lo], v)

    def copy_from(self, lo: int, hi: int, data: np.ndarray) -> None:
        """``self[lo:hi] = data``."""
        for s, e, v in self.cuts(lo, hi):
            np.copyto(v, data[s - lo : e - lo])


def copy_flat(src: np.ndarray | Pieces, dst: np.ndarray | Pieces) -> None:
    """``dst[:] = src`` unless they are the same memory."""
    if src is dst:
        return
    if isinstance(dst, Pieces):
        raise TypeError("copy_flat: pieces are written only in place")
    if isinstance(src, Pieces):
        src.copy_to(0, src.size, dst)
    elif not same_memory(src, dst):
        np.copyto(dst, src)
