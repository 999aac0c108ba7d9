"""The engine of a one-rank world: every collective is a copy."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..dtypes import DType
from ..ops import ReduceOp
from ..tensors import copy_flat


class LocalEngine:
    """``engines.base.Engine`` for one rank: nothing to meet, nothing to check."""

    name = "local"
    size = 1
    rank = 0
    heap = None

    def barrier(self) -> None:
        pass

    def refuse(self) -> None:
        pass  # no peer waits for the refused call

    def allreduce(self, src, dst, dt: DType, op: ReduceOp, shape) -> None:
        copy_flat(src, dst)

    def reduce_scatter(self, src, dst, dt: DType, op: ReduceOp, shape, counts) -> None:
        np.copyto(dst, src[: counts[0]])

    def allgather(self, src, dt: DType, row_shape, alloc: Callable[[list[int]], np.ndarray]):
        dst = alloc([src.size])
        np.copyto(dst, src)
        return dst

    def broadcast(self, buf, dt: DType, root: int, shape) -> None:
        pass

    def close(self) -> None:
        pass
