"""Elastic training for PyTorch (Horovod's ``horovod.torch.elastic``): ``TorchState``, which
commits, restores and synchronises models, optimizers, learning-rate schedulers and
elastic samplers besides plain values, and ``run``, the elastic loop of
``ddl.elastic``. What a commit keeps and when the loop restores it is the core's
(``ddl.elastic.State``); this module only says how each torch object is saved, restored
and sent from rank 0.

Differences from Horovod: a commit copies models and optimizers to host memory (a lost GPU
takes nothing committed with it); ``ElasticSampler`` re-shards without repeating or
skipping a sample (see its docstring), after every reset (sync or not), and merges the
ranks' processed indices when hosts change too, not only at a commit.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sized
from typing import Any

import torch

import ddl
from ddl.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    run,
    run_fn,
)
from ddl.elastic import sampler as _sampling

from .functions import broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import allgather_object, broadcast_object

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "StateHandler", "TorchState", "get_handler_registry", "run", "run_fn",
           "set_handler_registry"]


class ElasticSampler(torch.utils.data.Sampler):
    """Deals a dataset's indices to the ranks and, after the world changes, deals out what
    is left of the epoch to the new world.

    Record what each batch processed (``record_batch`` or ``record_indices``), keep the
    sampler in a ``TorchState`` (each commit merges every rank's processed indices), and
    call ``set_epoch`` at the end of each epoch (not the start: that would forget what a
    restarted epoch already did).

    ``pad=False`` (the default; Horovod pads): the indices not yet processed this epoch,
    in the epoch's order, are dealt to the ranks in turn, so shares differ by at most one
    and every index is processed exactly once per epoch, however often the world changes.
    Ranks may then run different numbers of batches: a loop with a collective per batch
    needs ``ddl.torch.join()`` at the end of the epoch, or ``pad=True``.
    ``pad=True``: Horovod's rule: the first indices are repeated until every share has the
    same length, so some samples are seen twice in an epoch that re-shards.

    ``shuffle``: the epoch's order is a permutation seeded with ``seed + epoch``, the same
    on every rank. ``dataset`` only needs a length, which must not change.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0, *,
                 pad: bool = False) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.pad = pad
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []  # this rank's share of remaining_indices
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet, the whole dataset dealt again."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batch ``batch_idx`` (of ``batch_size``) of this rank's share is processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Any) -> None:
        """These dataset indices are processed (for loops whose batches are not slices of
        the share)."""
        self.processed_indices.update(int(index) for index in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices batch ``batch_idx`` of ``batch_size`` covers in this rank's
        share."""
        return _sampling.batch(self.indices, batch_idx, batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Deal the indices not processed this epoch over the current world
        (``ddl.size()``, ``ddl.rank()``)."""
        self.num_replicas = ddl.size()
        self.rank = ddl.rank()
        order = _sampling.epoch_order(len(self.dataset), self.epoch, self.shuffle, self.seed)
        self.remaining_indices = _sampling.remaining(order, self.processed_indices)
        self.indices = _sampling.share(self.remaining_indices, self.rank, self.num_replicas,
                                       pad=self.pad)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)


class StateHandler:
    """How ``TorchState`` saves, restores and synchronises one kind of object. ``value``
    is the object; assigning a new one to the state's attribute saves it at once."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def on_interrupt(self) -> None:
        """Hosts changed and the state is kept (``HostsUpdatedInterrupt``), every rank of
        the old world is still here: make the ranks' objects agree if they can differ (a
        collective)."""

    def on_reset(self) -> None:
        """The world was re-formed (before any sync; local work only: new ranks are not
        here yet)."""

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


def _host_copy(obj: Any) -> Any:
    """A deep copy with every tensor copied to host memory (torch's ``load_state_dict``
    moves them back to the parameters' devices)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        # copy.copy keeps the kind of dict and its attributes: a module's state dict
        # carries in ``_metadata`` the versions its load_state_dict reads
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = _host_copy(value)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_host_copy(value) for value in obj)
    return copy.deepcopy(obj)


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: its ``state_dict()``, parameters and buffers, sent from rank 0
    by ``broadcast_parameters``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.save()

    def save(self) -> None:
        self._saved = _host_copy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer`` (a ``DistributedOptimizer`` too): its ``state_dict()``,
    sent from rank 0 by ``broadcast_optimizer_state``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.save()

    def save(self) -> None:
        self._saved = _host_copy(self.value.state_dict())

    def restore(self) -> None:
        # A copy: the optimizer keeps the tensors it loads (when device and dtype already
        # match) and steps them in place, which would change the commit itself.
        self.value.load_state_dict(_host_copy(self._saved))

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class LRSchedulerStateHandler(StateHandler):
    """A learning-rate scheduler: its ``state_dict()``, sent from rank 0 as an object."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


class SamplerStateHandler(StateHandler):
    """An ``ElasticSampler``: its epoch and the indices the whole world processed.

    Each rank records only its own batches, so the ranks' sets differ between merges. A
    commit merges them (a collective) and gives the merge to the live sampler too; so does
    a change of hosts that keeps the state (the work since the commit is in the kept model,
    and every rank must deal the rest from the same set). A sync sends rank 0's; after a
    reset the sampler deals what is left over the new world, also when no sync follows."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved = self.value.state_dict()

    def save(self) -> None:
        self.on_interrupt()
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))

    def on_interrupt(self) -> None:
        self.value.processed_indices = set().union(
            *allgather_object(self.value.processed_indices))

    def on_reset(self) -> None:
        self.value.reset()


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """The ``(type, handler class)`` pairs ``TorchState`` consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replace the registry (for objects of other types; states made later use it)."""
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any) -> StateHandler | None:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training process: ``model``, ``optimizer`` and any keyword
    argument, each an attribute. Objects the handler registry knows (modules, optimizers,
    LR schedulers, ``ElasticSampler``) are committed, restored and sent from rank 0 by
    their handler; the rest as plain values (``ObjectState``). Assigning a new object to
    such an attribute (``state.model = other``) hands it to the handler and saves it."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=ddl.rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def check_host_updates(self) -> None:
        try:
            super().check_host_updates()
        except HostsUpdatedInterrupt:
            for handler in self._handlers.values():
                handler.on_interrupt()
            raise

    def on_reset(self) -> None:
        for handler in self._handlers.values():
            handler.on_reset()
        super().on_reset()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
