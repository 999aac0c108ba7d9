"""Element types the engines move. numpy has no bfloat16, so bfloat16 travels as its uint16
bit pattern and is reduced in float32 (see ops.py). numpy arrays of ``ml_dtypes.bfloat16``
(what TensorFlow and JAX hand out) are bfloat16 too, viewed as uint16."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import DDLConfigError


@dataclass(frozen=True, eq=False)
class DType:
    """One entry of ``_TABLE``, its only maker: equal means the same object (a generated
    ``==`` compared every field, 0.17 us on each call's dtype checks), and a copy or an
    unpickled one is the table's own entry again (``__reduce__``)."""

    name: str
    code: int  # wire code, compared across ranks to detect mismatches
    storage: np.dtype  # how the bytes are viewed in numpy
    # Plain fields, not properties: they are read on every collective call.
    itemsize: int = field(init=False)
    is_float: bool = field(init=False)
    is_complex: bool = field(init=False)
    is_bool: bool = field(init=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "itemsize", self.storage.itemsize)
        set_(self, "is_float", self.name in ("float16", "bfloat16", "float32", "float64"))
        set_(self, "is_complex", self.storage.kind == "c")
        set_(self, "is_bool", self.name == "bool")

    def __reduce__(self) -> tuple:
        return (_by_name, (self.name,))


def _by_name(name: str) -> DType:
    return BY_NAME[name]


_TABLE = [
    DType("bool", 1, np.dtype(np.bool_)),
    DType("uint8", 2, np.dtype(np.uint8)),
    DType("int8", 3, np.dtype(np.int8)),
    DType("int16", 4, np.dtype(np.int16)),
    DType("uint16", 5, np.dtype(np.uint16)),
    DType("int32", 6, np.dtype(np.int32)),
    DType("uint32", 7, np.dtype(np.uint32)),
    DType("int64", 8, np.dtype(np.int64)),
    DType("uint64", 9, np.dtype(np.uint64)),
    DType("float16", 10, np.dtype(np.float16)),
    DType("bfloat16", 11, np.dtype(np.uint16)),
    DType("float32", 12, np.dtype(np.float32)),
    DType("float64", 13, np.dtype(np.float64)),
    DType("complex64", 14, np.dtype(np.complex64)),
    DType("complex128", 15, np.dtype(np.complex128)),
]
BY_NAME = {d.name: d for d in _TABLE}
BY_CODE = {d.code: d for d in _TABLE}
BFLOAT16 = BY_NAME["bfloat16"]


_BY_NUMPY: dict[np.dtype, DType] = {d.storage: d for d in _TABLE if d is not BFLOAT16}


def from_numpy(dtype: np.dtype) -> DType:
    d = _BY_NUMPY.get(dtype)  # fast path: numpy's name lookup costs microseconds
    if d is not None and dtype.isnative:
        return d
    dt = np.dtype(dtype)
    if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
        raise DDLConfigError(f"big-endian dtype {dt} is not supported; use native little-endian")
    d = BY_NAME.get(dt.name)
    if d is BFLOAT16 and dt.itemsize == 2 and dt == numpy_bfloat16():
        return d
    if d is None or d is BFLOAT16:
        raise DDLConfigError(
            f"dtype {dt} is not supported by ddl collectives "
            f"(supported: {', '.join(BY_NAME)})"
        )
    return d


_ML_BF16: list = []


def numpy_bfloat16() -> np.dtype | None:
    """numpy's bfloat16 dtype from ``ml_dtypes`` (installed with TensorFlow and JAX), or
    None without it."""
    if not _ML_BF16:
        try:
            import ml_dtypes

            _ML_BF16.append(np.dtype(ml_dtypes.bfloat16))
        except ImportError:
            _ML_BF16.append(None)
    return _ML_BF16[0]


def by_code(code: int) -> DType:
    return BY_CODE[code]
