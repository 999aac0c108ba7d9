"""Start every rank from the same state: Horovod's ``broadcast_parameters`` and
``broadcast_optimizer_state``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import ddl

from . import collectives


def broadcast_parameters(params: Mapping[str, Any] | Iterable[Any], root_rank: int = 0) -> None:
    """Overwrite parameters/buffers in place with ``root_rank``'s.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` or a list of tensors.
    """
    if isinstance(params, Mapping):
        items = sorted(params.items())  # same order on every rank whatever the dict order
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            continue
        handles.append(ddl.broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p,
                                            root_rank, name=f"broadcast.{name}"))
    for h in handles:
        h.wait()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state (moments, step counts, learning rates...) the root's.

    The whole ``state_dict()`` travels as one object, so ranks whose state is still empty
    (no step taken yet) receive the root's structure too.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    state = collectives.broadcast_object(inner.state_dict(), root_rank)
    if ddl.rank() != root_rank:
        inner.load_state_dict(state)
