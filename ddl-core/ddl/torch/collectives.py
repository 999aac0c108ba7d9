"""alltoall for the ``ddl`` ProcessGroup, built from the collectives the core has.

They are correct for every engine because they use only the public ``ddl.*`` API; they are
not as fast as a native implementation would be (alltoall moves every rank's whole tensor to
every rank), which is fine for the control-plane uses they serve.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

import ddl
from ddl.hvd.collectives import alltoall_receive, alltoall_splits


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
    # (rows, elements per row), never -1: a row of no elements ([2, 0]) leaves it undetermined
    row = int(np.prod(tuple(tensor.shape[1:]), dtype=np.int64)) if tensor.dim() else 1
    data = ddl.allgather(tensor.reshape(rows, row), group=group)
    return alltoall_receive(table, data, tuple(tensor.shape[1:]), me)


__all__ = ["alltoall"]
