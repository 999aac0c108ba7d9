"""Start every rank from the same state: Horovod's ``broadcast_parameters`` and
``broadcast_optimizer_state``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import ddl

from .mpi_ops import broadcast_group_, broadcast_object


def broadcast_parameters(params: Mapping[str, Any] | Iterable[Any], root_rank: int = 0) -> None:
    """Overwrite parameters/buffers in place with ``root_rank``'s.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` or a list of tensors.
    """
    # One call covering every tensor: ranks whose models differ (another count, dtype or
    # shape) raise on every rank instead of pairing one tensor with another.
    broadcast_group_(lambda: _tensors(params), root_rank, what="broadcast_parameters")


def _tensors(params: Mapping[str, Any] | Iterable[Any]) -> list[torch.Tensor]:
    if isinstance(params, Mapping):
        items = sorted(params.items())  # same order on every rank whatever the dict order
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    return [p.data if isinstance(p, torch.nn.Parameter) else p
            for _, p in items if isinstance(p, torch.Tensor)]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state (moments, step counts, learning rates...) the root's.

    The whole ``state_dict()`` travels as one object, so ranks whose state is still empty
    (no step taken yet) receive the root's structure too.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    state = broadcast_object(inner.state_dict(), root_rank)
    if ddl.rank() != root_rank:
        inner.load_state_dict(state)
