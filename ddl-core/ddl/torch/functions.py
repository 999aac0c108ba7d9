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

    As Horovod, an optimizer with no state yet (no step taken) is given it first: every
    parameter that requires grad gets a zero gradient, and the wrapped optimizer takes one
    step (no allreduce), which makes its moments and step counts. Unlike Horovod's, that step
    leaves the parameters as they were (with weight decay it would move them, and move
    them on some ranks only when only the root has state). The whole ``state_dict()`` then
    travels as one object, so any structure the root's state has reaches every rank (LBFGS
    included, which Horovod refuses).
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not inner.state_dict()["state"]:
        _make_state(inner)
    state = broadcast_object(inner.state_dict(), root_rank)
    if ddl.rank() != root_rank:
        inner.load_state_dict(state)


def _make_state(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's initialisation of a new optimizer's state: zero gradients, one step."""
    if isinstance(optimizer, torch.optim.LBFGS):  # its step needs a closure
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    kept = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
        if isinstance(optimizer, torch.optim.SparseAdam):
            p.grad = p.grad.to_sparse()
    optimizer.step()
    with torch.no_grad():
        for p, k in zip(params, kept):
            p.copy_(k)
