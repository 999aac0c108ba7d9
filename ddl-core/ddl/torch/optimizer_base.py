"""torch.optim's side of a wrapping optimizer, shared by both DistributedOptimizers
(:mod:`ddl.torch.optimizer`, :mod:`ddl.torch.adasum_optimizer`): the argument checks every
one makes first, in Horovod's order, and a base class whose ``param_groups``, ``state``,
``defaults`` and state dict are the wrapped optimizer's own, with the per-parameter state
both optimizers share (Horovod's attributes, the count of backward passes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

import ddl
from ddl.hvd import negotiate as ng
from ddl.hvd.collectives import check_process_set
from ddl.hvd.process_sets import ProcessSet, by_id

__all__ = ["WrappedOptimizer", "checked_arguments", "set_scope", "too_many_passes"]


def set_scope(process_set: Any) -> tuple[bool, ng._State | None]:
    """Whether this rank is in ``process_set`` and, when the set is not the global one, the
    set's protocol state (None on ranks outside it, and for the global set). An unknown or
    unregistered set raises, as its collectives do."""
    if (isinstance(process_set, ProcessSet) and process_set.process_set_id is not None
            and by_id(process_set.process_set_id) is process_set
            and not process_set.included()):
        return False, None
    st = check_process_set(process_set)
    return True, (None if st.group is None else st)


def checked_arguments(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None,
                      process_set: Any, backward_passes_per_step: int,
                      set_refusal: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """What every DistributedOptimizer checks first, in Horovod's order (its ValueErrors
    before anything else), and (name, param) for every parameter of ``optimizer``; with
    ``set_refusal``, a non-global ``process_set`` raises NotImplementedError(set_refusal)."""
    named = _named(optimizer, named_parameters)
    included, st = set_scope(process_set)
    if set_refusal is not None and (st is not None or not included):
        raise NotImplementedError(set_refusal)
    if not ddl.is_initialized():
        raise ddl.DDLError("call hvd.init() (ddl.torch.init()) before DistributedOptimizer")
    if backward_passes_per_step < 1:
        raise ddl.DDLConfigError(
            f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    return named


def too_many_passes(name: str, bpps: int) -> ddl.DDLError:
    """A gradient computed more often than backward_passes_per_step before step()."""
    return ddl.DDLError(
        f"gradient of {name!r} was computed more than backward_passes_per_step={bpps} "
        "times before step(): call step() (or synchronize()) after each backward, or raise "
        "backward_passes_per_step to accumulate gradients locally")


def _named(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None
           ) -> list[tuple[str, torch.Tensor]]:
    """Validate ``named_parameters`` like Horovod and return (name, param) for every
    parameter of the optimizer, in its order."""
    params, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    if named_parameters is None:
        return [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ddl.DDLConfigError(
            "named_parameters should be a sequence of (name, parameter) tuples, "
            "usually model.named_parameters()"
        )
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ddl.DDLConfigError(f"parameter names in named_parameters must be unique: {dups}")
    name_of = {id(p): n for n, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in name_of]
    if unnamed:
        raise ddl.DDLConfigError(
            f"named_parameters was given, but {len(unnamed)} parameter(s) of the optimizer "
            f"(positions {unnamed[:5]}) are not in it: pass model.named_parameters() of the "
            "model whose parameters the optimizer updates"
        )
    return [(name_of[id(p)], p) for p in params]


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch optimizer that wraps another: it shares the wrapped one's ``param_groups``,
    ``state`` and ``defaults``, and its state dict is the wrapped one's. Subclasses call
    :meth:`_init_base` first in their constructor, then :meth:`_init_parameters`."""

    def _init_base(self, optimizer: torch.optim.Optimizer) -> None:
        """Run torch.optim.Optimizer's own constructor: it builds what the base class's
        methods need (the tables behind ``register_step_pre_hook`` & co, the wrapper that
        runs them around ``step()``), whatever this torch version keeps there.

        It also sets ``defaults``, ``state`` and ``param_groups``, which the properties
        route to the wrapped optimizer: it gets that optimizer's own defaults and copies of
        its groups, and the optimizer's own state and group list are put back after it, so
        the wrapper shares them and the wrapped optimizer is left as it was."""
        self._opt = optimizer
        state, groups = optimizer.state, optimizer.param_groups
        self._wrapped_params = {id(p) for g in groups for p in g["params"]}
        try:
            torch.optim.Optimizer.__init__(self, [dict(g) for g in groups],
                                           optimizer.defaults)
        finally:
            optimizer.state, optimizer.param_groups = state, groups

    def _init_parameters(self, named: list[tuple[str, torch.Tensor]], compression: Any,
                         backward_passes_per_step: int) -> None:
        """The per-parameter state of a DistributedOptimizer, under Horovod's attribute
        names where Horovod has one. Only parameters that require a gradient are reduced:
        frozen ones never sync."""
        self._compression = compression
        self._bpps = backward_passes_per_step
        self._parameter_names = {p: n for n, p in named}
        self._names = [n for n, p in named if p.requires_grad]
        self._params = [p for _, p in named if p.requires_grad]
        self._requires_update = set(self._params)
        self._passes = [0] * len(self._params)  # this step's backward passes per gradient
        self._synchronized, self._should_synchronize = False, True

    def _count_pass(self, i: int) -> bool:
        """One more backward pass of gradient ``i`` this step: whether it was the last one
        (``backward_passes_per_step``); one more than that raises."""
        self._passes[i] += 1
        if self._passes[i] > self._bpps:
            raise too_many_passes(self._names[i], self._bpps)
        return self._passes[i] == self._bpps

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._opt.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._opt.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._opt.state

    @state.setter
    def state(self, value: Any) -> None:
        self._opt.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._opt.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._opt.defaults = value

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._opt

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer cannot be pickled; save optimizer.state_dict()")

    # ------------------------------------------------------------- checkpoints
    # The wrapper's state dict is the wrapped optimizer's (its state, its class's own
    # saving), so torch runs state-dict hooks there: hooks registered on the wrapper are
    # registered on the wrapped optimizer, and called with the wrapper, as torch documents.
    def register_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False
                                     ) -> RemovableHandle:
        return self._opt.register_state_dict_pre_hook(lambda _: hook(self), prepend=prepend)

    def register_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False
                                      ) -> RemovableHandle:
        return self._opt.register_state_dict_post_hook(lambda _, sd: hook(self, sd),
                                                       prepend=prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable[..., Any],
                                          prepend: bool = False) -> RemovableHandle:
        return self._opt.register_load_state_dict_pre_hook(lambda _, sd: hook(self, sd),
                                                           prepend=prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[..., Any],
                                           prepend: bool = False) -> RemovableHandle:
        return self._opt.register_load_state_dict_post_hook(lambda _: hook(self),
                                                            prepend=prepend)

    def state_dict(self) -> dict[str, Any]:
        return self._opt.state_dict()
