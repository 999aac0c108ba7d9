"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation"), with
Horovod's semantics, for every framework adapter.

Two gradients ``a`` and ``b`` are combined as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add up, equal ones are not counted twice, and in between a part of
their common direction is kept once. A side whose squared norm is below 1e-8 (Horovod's
threshold, for a zero gradient) keeps coefficient 1. Over ``n`` ranks the pairs form a
binary tree by distance doubling, the lower rank on the left, as Horovod's vector-halving
distance-doubling reduction computes it::

    level 1: (0,1) (2,3) (4,5) (6,7)   level 2: (01, 23) (45, 67)   level 3: (0123, 4567)

Coefficients are per tensor, also inside a grouped or fused call (Horovod's
``tensor_counts``), with dot products and norms accumulated in float64. Each level's result
is stored in the tensor's dtype, as Horovod's buffer holds it: float32 and float64 combine
in float64, float16 and bfloat16 in float32. ``n`` must be a power of two (Horovod's rule
on the CPU).

How it moves: ddl has no point-to-point layer, so the call is one allgather of every rank's
flat vector (per dtype), and each rank evaluates the whole tree itself, in the same order.
The pairs' coefficients of the lowest rank are then broadcast (a few float64 per tensor and
pair): a rank whose own differ (dot products are sums, which another CPU kind may round
differently) redoes the scaled adds with them, which are elementwise and exact to repeat.
Every rank then holds bitwise the same result. The cost is the allgather: each rank
receives ``(n - 1)`` times the data (Horovod's halving-doubling moves about twice the data
whatever ``n``), so this suits the small power-of-two jobs Adasum is used on today.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import dtypes as _dtypes
from ..errors import DDLConfigError
from ..ops import _bf16_to_f32, _f32_to_bf16

# The descriptor's op word for Adasum: one past ddl.ReduceOp's codes (Sum..Product = 1..5),
# so an Adasum call never pairs with another op's.
ADASUM_CODE = 6
_ZERO_NORMSQ = 1e-8  # below this squared norm a side is "zero": coefficient 1 (Horovod)
_FLOATS = ("float16", "bfloat16", "float32", "float64")


class AdasumOp:
    """``hvd.Adasum``: the reduction op of :mod:`ddl.hvd.adasum` (one instance)."""

    name = "ADASUM"
    value = ADASUM_CODE

    def __repr__(self) -> str:
        return "hvd.Adasum"

    def __reduce__(self) -> str:
        return "Adasum"  # pickles as the module's one instance


Adasum = AdasumOp()


class AdasumSizeError(DDLConfigError, NotImplementedError):
    """Adasum on a number of ranks that is not a power of two. Also a NotImplementedError,
    the type Horovod raises for it."""


def is_adasum(op: Any) -> bool:
    """Whether ``op`` asks for Adasum (``hvd.Adasum``, or the string ``"adasum"``)."""
    return isinstance(op, AdasumOp) or (isinstance(op, str) and op.lower() == "adasum")


def check_size(n: int) -> None:
    if n < 1 or n & (n - 1):
        raise AdasumSizeError(
            f"Adasum needs a power-of-two number of ranks (as Horovod's CPU Adasum), got {n}: "
            "run on 1, 2, 4, 8... ranks, or use op=hvd.Average")


def check_dtype(code: int) -> _dtypes.DType:
    dt = _dtypes.BY_CODE[code]
    if dt.name not in _FLOATS:
        raise DDLConfigError(
            f"Adasum is defined for float16, bfloat16, float32 and float64 tensors, not "
            f"{dt.name}; cast it, or use op=hvd.Sum")
    return dt


# ------------------------------------------------------------------ the arithmetic
def _widen(x: np.ndarray, dt: _dtypes.DType) -> np.ndarray:
    """The dtype the scaled add runs in: float32 for the half types, float64 otherwise."""
    if dt is _dtypes.BFLOAT16:
        return _bf16_to_f32(x)
    if dt.name == "float16":
        return x.astype(np.float32)
    return x.astype(np.float64, copy=False)


def _narrow(x: np.ndarray, dt: _dtypes.DType) -> np.ndarray:
    if dt is _dtypes.BFLOAT16:
        out = np.empty(x.shape, dtype=np.uint16)
        _f32_to_bf16(np.ascontiguousarray(x, dtype=np.float32), out)
        return out
    return x.astype(dt.storage, copy=False)


def coefficients(a: np.ndarray, b: np.ndarray, numels: Sequence[int]) -> np.ndarray:
    """Each segment's (``numels`` elements each, in order) coefficients of ``a`` and ``b``
    (widened vectors), from dot products and squared norms accumulated in float64: shape
    ``(segments, 2)``; an empty segment gets (1, 1)."""
    out = np.ones((len(numels), 2), dtype=np.float64)
    start = 0
    for k, n in enumerate(numels):
        end = start + int(n)
        if n:
            sa = a[start:end].astype(np.float64, copy=False)
            sb = b[start:end].astype(np.float64, copy=False)
            dot = float(np.dot(sa, sb))
            anormsq, bnormsq = float(np.dot(sa, sa)), float(np.dot(sb, sb))
            if anormsq >= _ZERO_NORMSQ:
                out[k, 0] = 1.0 - dot / anormsq * 0.5
            if bnormsq >= _ZERO_NORMSQ:
                out[k, 1] = 1.0 - dot / bnormsq * 0.5
        start = end
    return out


def scaled_add(a: np.ndarray, b: np.ndarray, numels: Sequence[int], coefs: np.ndarray
               ) -> np.ndarray:
    """``coefs[k, 0] * a + coefs[k, 1] * b`` on each segment ``k`` of two widened vectors, in
    their dtype (a new array). Elementwise IEEE operations only, so the same coefficients
    give bitwise the same result on any CPU."""
    out = np.empty_like(a)
    kind = a.dtype.type
    start = 0
    for k, n in enumerate(numels):
        end = start + int(n)
        if n:
            np.multiply(a[start:end], kind(coefs[k, 0]), out=out[start:end])
            out[start:end] += kind(coefs[k, 1]) * b[start:end]
        start = end
    return out


def combine(a: np.ndarray, b: np.ndarray, numels: Sequence[int], dt: _dtypes.DType
            ) -> np.ndarray:
    """``adasum(a, b)`` of each segment (``numels`` elements each, in order) of two flat
    vectors in ``dt``'s storage; the result in the same storage."""
    wa, wb = _widen(a, dt), _widen(b, dt)
    return _narrow(scaled_add(wa, wb, numels, coefficients(wa, wb, numels)), dt)


def tree(rows: np.ndarray, numels: Sequence[int], dt: _dtypes.DType,
         coefs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Adasum over ranks of ``rows`` (one flat vector per rank, in rank order, in ``dt``'s
    storage): the distance-doubling binary tree, lower rank on the left. Returns the result
    and the coefficients of each pair, shape ``(n - 1, segments, 2)`` in the order the pairs
    were combined (level by level, left to right). Given ``coefs``, uses those instead of
    its own dot products (so every rank can adopt one rank's: dot products are sums whose
    rounding may differ between CPU kinds, the scaled adds are not)."""
    n = rows.shape[0]
    check_size(n)
    used = np.ones((n - 1, len(numels), 2), dtype=np.float64)
    level = [rows[i] for i in range(n)]
    dist, pair = 1, 0
    while dist < n:
        for left in range(0, n, 2 * dist):
            wa, wb = _widen(level[left], dt), _widen(level[left + dist], dt)
            used[pair] = coefficients(wa, wb, numels) if coefs is None else coefs[pair]
            level[left] = _narrow(scaled_add(wa, wb, numels, used[pair]), dt)
            pair += 1
        dist *= 2
    return np.array(level[0], copy=True), used


__all__ = [
    "ADASUM_CODE", "Adasum", "AdasumOp", "AdasumSizeError", "check_dtype", "check_size",
    "coefficients", "combine", "is_adasum", "scaled_add", "tree",
]
