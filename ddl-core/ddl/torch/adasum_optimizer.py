"""``hvd.DistributedOptimizer(..., op=hvd.Adasum)``: Horovod's ``_DistributedAdasumOptimizer``.

Adasum combines what each rank's optimizer would do, not the gradients: every rank applies
its own optimizer step to its own (local, not averaged) gradients, so optimizer state such
as momentum stays per rank; the step's parameter *delta* (new - old) is combined over ranks
with Adasum (:mod:`ddl.hvd.adasum`, coefficients per parameter), and every parameter is set
to old + combined delta, the same on every rank. ``backward_passes_per_step`` counts
backward passes as in Horovod (more than that before ``step()`` raises; the gradients add
up locally); ``synchronize()`` does nothing and ``skip_synchronize()`` raises, as there;
and, as there, construction gives every parameter that requires a gradient a zero ``.grad``.

Horovod starts each parameter's step and allreduce from its gradient hook; here ``step()``
steps the wrapped optimizer once and reduces every delta in one grouped call (the same
per-parameter result; optimizers whose update couples parameters see them all at once, as
a plain ``step()`` would).

:class:`AdasumDeltas` is that behaviour, mixed before the plain optimizer into
:class:`ddl.torch.optimizer.DistributedAdasumOptimizer`, which ``DistributedOptimizer``
returns, so ``isinstance(opt, hvd.DistributedOptimizer)`` holds as for the plain one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import ddl
from ddl.hvd import collectives as C
from ddl.hvd.adasum import Adasum, check_size
from ddl.hvd.compression import Compression, Compressor
from ddl.hvd.process_sets import global_process_set

from .optimizer_base import WrappedOptimizer, checked_arguments


class AdasumDeltas(WrappedOptimizer):
    """The Adasum optimizer's construction, hooks and ``step()``, which override the plain
    DistributedOptimizer's (same arguments). Fusion settings and ``sparse`` are accepted and
    unused: the deltas go as one grouped call."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        compression: type[Compressor] = Compression.none,
        backward_passes_per_step: int = 1,
        op: Any = Adasum,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        process_set: Any = None,
        *,
        fusion_threshold_bytes: int | None = None,
        cycle_time_ms: float | None = None,
        sparse: bool | dict = False,
    ) -> None:
        named = checked_arguments(optimizer, named_parameters, process_set,
                                  backward_passes_per_step, "Adasum does not support "
                                  "non-global process sets (as in Horovod)")
        if gradient_predivide_factor != 1.0:
            raise ddl.DDLConfigError("gradient_predivide_factor needs op=Average, not Adasum")
        check_size(ddl.size())
        self._init_base(optimizer)
        self._init_parameters(named, compression, backward_passes_per_step)
        self.process_set = global_process_set
        # Horovod's _DistributedAdasumOptimizer gives every parameter that requires a
        # gradient a fresh zero one when it is built (replacing any it had), so code that
        # reads .grad before the first backward sees zeros; the plain optimizer does not.
        with torch.no_grad():
            for p in self._params:
                p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self._params)]

    @property
    def _handles(self) -> dict:
        """Nothing in flight between calls: the deltas are combined inside ``step()``."""
        return {}

    def __repr__(self) -> str:
        return f"DistributedAdasumOptimizer({self._opt!r})"

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self._count_pass(i)  # the gradients add up locally until step()

        return hook

    def synchronize(self) -> None:
        """Nothing to do: the deltas are combined inside ``step()`` (as in Horovod)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise ddl.DDLConfigError(
            "skip_synchronize() is not supported with op=hvd.Adasum (as in Horovod): the "
            "parameter deltas are combined in step(), after the local update")
        yield  # pragma: no cover - a generator for contextmanager

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        with torch.no_grad():
            start = [p.detach().clone() for p in self._params]
            self._opt.step()
            deltas = [p.detach() - s for p, s in zip(self._params, start)]
        self._passes = [0] * len(self._params)
        combined = C.grouped_allreduce(deltas, op=Adasum, compression=self._compression,
                                       name=None)
        with torch.no_grad():
            for p, s, d in zip(self._params, start, combined):
                p.copy_(s.add_(d))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._opt.zero_grad(set_to_none=set_to_none)

    @property
    def buckets(self) -> list:
        """No fusion plan: the deltas go as one grouped call per step."""
        return []

    @property
    def exchange_modes(self) -> list[str | None]:
        return []
