"""Collectives the core does not have, built from the ones it has (alltoall), and the
pickling of the object collectives.

They are correct for every engine because they use only the public ``ddl.*`` API; they are
not as fast as a native implementation would be (alltoall moves every rank's whole tensor to
every rank), which is fine for the control-plane uses they serve.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import ddl


def alltoall_splits(rows: int, splits: Sequence[int] | None, n: int | None = None
                    ) -> list[int]:
    """How many rows go to each of ``n`` ranks (the job's by default): ``splits``,
    checked, or an even split."""
    n = ddl.size() if n is None else n
    if splits is None:
        if rows % n:
            raise ddl.DDLConfigError(
                f"alltoall: dimension 0 has {rows} rows, not divisible by {n} ranks; pass splits"
            )
        return [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ddl.DDLConfigError(
            f"alltoall: splits {splits} must be {n} non-negative counts summing to {rows}"
        )
    return splits


def alltoall_receive(table: np.ndarray, data: torch.Tensor, tail: tuple[int, ...],
                     me: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``me``'s rows (this rank's by default) out of every rank's gathered rows
    (``table[i][j]``: rows rank i sends to rank j, in j order), and how many came from
    each rank."""
    me = ddl.rank() if me is None else me
    pieces, start = [], 0
    for i in range(table.shape[0]):
        off = start + int(table[i, :me].sum())
        pieces.append(data[off:off + int(table[i, me])])
        start += int(table[i].sum())
    out = torch.cat(pieces).reshape((-1,) + tuple(tail))
    return out, torch.from_numpy(np.ascontiguousarray(table[:, me]))


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | None = None, *,
             group: ddl.Group | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[j]`` rows of ``tensor`` (dim 0, in order) to rank ``j`` (of ``group``,
    or of the job); return the rows received, in rank order, and how many came from each
    rank."""
    rows = tensor.shape[0] if tensor.dim() else 1
    n, me = (ddl.size(), ddl.rank()) if group is None else (group.size, group.rank)
    splits = alltoall_splits(rows, splits, n)
    # table[i][j]: rows rank i sends to rank j
    table = ddl.allgather(np.asarray([splits], dtype=np.int64), group=group)
    data = ddl.allgather(tensor.reshape(rows, -1) if tensor.dim() else tensor.reshape(1, 1),
                         group=group)
    return alltoall_receive(table, data, tuple(tensor.shape[1:]), me)


def dumps(obj: Any) -> np.ndarray:
    """``obj`` pickled (tensors on any device included) as bytes to send."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return np.frombuffer(buf.getbuffer(), dtype=np.uint8).copy()


def loads(data: np.ndarray) -> Any:
    return torch.load(io.BytesIO(data.tobytes()), weights_only=False)


__all__ = ["alltoall", "alltoall_receive", "alltoall_splits", "dumps", "loads"]
