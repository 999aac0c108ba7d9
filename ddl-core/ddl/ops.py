"""Reduction operators and the one reduction kernel every engine uses.

Terms are reduced left to right into ``out``; callers fix the order so that results are
deterministic. ``out`` may be the very same memory as ``terms[0]`` (never a later term).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from .dtypes import DType
from .errors import DDLConfigError


class ReduceOp(enum.IntEnum):
    SUM = 1
    AVERAGE = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Sum = ReduceOp.SUM
Average = ReduceOp.AVERAGE
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def parse_op(op: object) -> ReduceOp:
    if op.__class__ is ReduceOp:
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            pass
    elif isinstance(op, int) and op in ReduceOp._value2member_map_:
        return ReduceOp(op)
    raise DDLConfigError(f"unknown reduce op {op!r}: use ddl.Sum, Average, Min, Max or Product")


def check_op(op: ReduceOp, dtype: DType) -> None:
    """Refuse combinations that have no sensible meaning instead of silently producing one."""
    if op is Sum or dtype.is_float:
        return
    if op is Average and not dtype.is_complex:
        raise DDLConfigError(
            f"Average is not defined for {dtype.name} tensors (integer division would "
            "silently truncate); reduce with Sum and divide, or cast to a float type"
        )
    if (op is Min or op is Max) and dtype.is_complex:
        raise DDLConfigError(f"{op.name.title()} is not defined for complex dtype {dtype.name}")


def _bf16_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    wide = bits.astype(np.uint32) << 16
    if out is None:
        return wide.view(np.float32)
    out.view(np.uint32)[...] = wide
    return out


def _f32_to_bf16(x: np.ndarray, out: np.ndarray) -> None:
    """Round to nearest even, as torch does; NaNs stay (quiet) NaNs."""
    u = x.view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    r = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    out[...] = r


def reduce_into(
    out: np.ndarray, terms: Sequence[np.ndarray], op: ReduceOp, dtype: DType, divisor: int = 1
) -> None:
    """out = terms[0] (op) terms[1] (op) ... ; then / divisor for Average."""
    if dtype.name == "bfloat16":
        _reduce_bf16(out, terms, op, divisor)
        return
    if len(terms) == 1:
        if out is not terms[0]:
            np.copyto(out, terms[0])
    else:
        ufunc = _UFUNC[op]
        if ufunc is np.add or ufunc is np.multiply:
            ufunc(terms[0], terms[1], out)  # out= by position: numpy parses no keywords
            for i in range(2, len(terms)):
                ufunc(out, terms[i], out)
        else:  # numpy 2.4 deprecates a positional out for minimum and maximum
            ufunc(terms[0], terms[1], out=out)
            for i in range(2, len(terms)):
                ufunc(out, terms[i], out=out)
    if op is Average and divisor != 1:
        if divisor & (divisor - 1) == 0 and out.dtype.kind == "f":
            # x * 2**-k is x / 2**k exactly (both round the same real number), and a
            # multiply costs a fraction of a divide: most of Average's cost at 2 or 4 ranks
            np.multiply(out, 1.0 / divisor, out=out)
        else:
            np.divide(out, divisor, out=out, casting="unsafe")


def _reduce_bf16(out: np.ndarray, terms: Sequence[np.ndarray], op: ReduceOp, divisor: int) -> None:
    # Accumulate in float32 and round once: deterministic and more accurate than bf16 steps.
    ufunc = _UFUNC[op]
    acc = _bf16_to_f32(terms[0]).copy()
    tmp = np.empty_like(acc)
    for t in terms[1:]:
        ufunc(acc, _bf16_to_f32(t, tmp), out=acc)
    if op is Average and divisor != 1:
        np.divide(acc, np.float32(divisor), out=acc)
    _f32_to_bf16(acc, out)
