"""Horovod's ``DistributedOptimizer`` on the ddl core.

Each parameter gets a post-accumulate-grad hook. When every gradient of a fusion bucket is
ready (after ``backward_passes_per_step`` passes), the bucket is packed (and compressed) into
its fusion buffer and its allreduce is queued (asynchronously, in place), so
communication overlaps the rest of backward. ``synchronize()`` (called by ``step()``)
launches what is left, waits, and unpacks the averaged gradients into ``p.grad``.

The buckets (plan, buffers, packing, launch order, replanning) are a
:class:`~ddl.torch.bucket_exchange.BucketExchange`; this module keeps torch.optim's side:
the wrapper's construction and shared state, the hooks, ``step()``/``synchronize()``.

Buckets come from :mod:`ddl.hvd.fusion` and are launched strictly in plan order, which is
what keeps every rank's sequence of collectives identical without a coordinator. Each bucket
allreduce is one negotiated call (:mod:`ddl.hvd.negotiate`), so ranks that called
``hvd.join()`` (out of data) contribute zeros and the others finish their epoch (Horovod's
uneven-data rule), and a bucket that differs between ranks raises on every rank.

Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as Horovod does, the allgather
of their indices and values, unless ``sparse_as_dense=True``; ``op=hvd.Adasum`` on more than
one rank gives the delta-combining optimizer of :mod:`ddl.torch.adasum_optimizer`.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

import ddl
from ddl.hvd import collectives as C
from ddl.hvd import fusion
from ddl.hvd.adasum import is_adasum
from ddl.hvd.collectives import resolve_op
from ddl.hvd.compression import Compression, Compressor
from ddl.hvd.join import broadcast_plan, register_optimizer
from ddl.hvd.process_sets import global_process_set
from ddl.hvd.settings import cycle_time_ms as _default_cycle_ms
from ddl.hvd.settings import fusion_threshold_bytes as _default_threshold

from .adasum_optimizer import AdasumDeltas
from .bucket_exchange import BucketExchange, Exchange
from .optimizer_base import WrappedOptimizer, checked_arguments, set_scope

__all__ = ["DistributedAdasumOptimizer", "DistributedOptimizer", "Exchange"]


def _group_indices(params: Sequence[torch.Tensor], num_groups: int,
                   groups: Sequence[Sequence[torch.Tensor]] | None) -> list[list[int]] | None:
    """Horovod's ``num_groups``/``groups`` as lists of indices into ``params`` (None: plan
    the buckets by size and timing)."""
    if num_groups:
        return fusion.split_evenly(len(params), num_groups)
    if groups is None:
        return None
    index = {id(p): i for i, p in enumerate(params)}
    out, seen = [], set()
    for g in groups:
        idx = []
        for p in g:
            i = index.get(id(p))
            if i is None:
                raise ddl.DDLConfigError("groups contains a tensor that is not a trainable "
                                         "parameter of the optimizer")
            idx.append(i)
        seen.update(idx)
        out.append(idx)
    rest = [i for i in range(len(params)) if i not in seen]
    if rest:  # Horovod: parameters outside every group are reduced one by one
        out.extend([i] for i in rest)
    return out


class DistributedOptimizer(WrappedOptimizer):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks (over
    the ranks of ``process_set`` when given; the others step on their own gradients).

    Same arguments as ``horovod.torch.DistributedOptimizer``, plus the fusion settings:
    ``fusion_threshold_bytes`` (default ``DDL_FUSION_THRESHOLD``, 128 MiB; 0 disables
    fusion) and ``cycle_time_ms`` (default ``DDL_CYCLE_TIME``, 1 ms; 0 keeps the
    size-only plan). ``sparse=`` (an earlier Horovod's keyword) is accepted and changes
    nothing: sparse gradients are always allgathered. The wrapper shares
    ``param_groups``/``state``/``defaults`` with ``optimizer``, so LR schedulers and
    checkpoints work on either; step hooks registered on the wrapper run around its
    ``step()``, state-dict hooks around the wrapped optimizer's
    ``state_dict()``/``load_state_dict()``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> DistributedOptimizer:
        # Horovod's factory: op=hvd.Adasum on more than one rank gets the delta-combining
        # optimizer (a subclass, so Python then runs its __init__ with these arguments).
        op = args[4] if len(args) > 4 else kwargs.get("op")
        if cls is DistributedOptimizer and is_adasum(op) and ddl.is_initialized() and (
                ddl.size() > 1):
            cls = DistributedAdasumOptimizer
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        compression: type[Compressor] = Compression.none,
        backward_passes_per_step: int = 1,
        op: Any = ddl.Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Sequence[Sequence[torch.Tensor]] | None = None,
        sparse_as_dense: bool = False,
        process_set: Any = None,
        *,
        fusion_threshold_bytes: int | None = None,
        cycle_time_ms: float | None = None,
        sparse: bool | dict = False,
    ) -> None:
        # ``sparse`` is an earlier Horovod's keyword, which its tests still pass: there it
        # was stored and never read (a gradient's own layout chose allgather), as here.
        del sparse
        # Argument errors first, as Horovod raises them (ValueError) before anything else
        named = checked_arguments(optimizer, named_parameters, process_set,
                                  backward_passes_per_step)
        # Adasum of one rank's delta is that delta: the plain optimizer, as in Horovod
        op = ddl.Average if is_adasum(op) else resolve_op(None, op)
        if gradient_predivide_factor != 1.0 and op is not ddl.Average:
            raise ddl.DDLConfigError("gradient_predivide_factor needs op=Average")
        if num_groups and groups is not None:
            raise ddl.DDLConfigError("pass num_groups or groups, not both")
        self._init_base(optimizer)
        # Horovod's attributes, with its meaning
        self.process_set = global_process_set if process_set is None else process_set
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self._init_parameters(named, compression, backward_passes_per_step)
        # A process set: its ranks reduce the gradients among themselves; the others do not
        # take part (no hooks; their step() applies their own gradients), as in Horovod.
        self._included, self._set_scope = set_scope(process_set)
        self._exchange = BucketExchange(
            self._params, compression=compression, op=op,
            predivide=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
            threshold_bytes=(_default_threshold() if fusion_threshold_bytes is None
                             else int(fusion_threshold_bytes)),
            cycle_time_s=(_default_cycle_ms() if cycle_time_ms is None
                          else float(cycle_time_ms)) / 1000.0,
            groups=_group_indices(self._params, num_groups, groups),
            scope=self._set_scope, process_set=process_set)
        self._lock = threading.Lock()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self._params)] if self._included else []
        # every rank registers (the index is the same everywhere); only optimizers of the
        # global set ever broadcast a plan under it
        self._join_index = register_optimizer(self)

    # ------------------------------------------------------------- Horovod's state
    @property
    def backward_passes_per_step(self) -> int:
        return self._bpps

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self.set_backward_passes_per_step(passes)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's: a new count of backward passes per step, this step's count restarted."""
        if int(passes) < 1:
            raise ddl.DDLConfigError(f"backward_passes_per_step must be >= 1, got {passes}")
        if self._handles:
            raise ddl.DDLError("set_backward_passes_per_step: this step's allreduces are in "
                               "flight; call it before backward or after step()")
        self._bpps = int(passes)
        self._passes = [0] * len(self._params)

    @property
    def _allreduce_delay(self) -> dict[torch.Tensor, int]:
        """Horovod's: per parameter, the backward passes left before its allreduce."""
        return {p: self._bpps - n for p, n in zip(self._params, self._passes)}

    @property
    def _handles(self) -> dict[torch.Tensor, Any]:
        """Horovod's: the allreduces in flight this step, per parameter (a parameter's handle
        is its fusion bucket's); empty between steps."""
        return {self._params[i]: (h, None) for i, h in self._exchange.handles().items()}

    @staticmethod
    def find_duplicates(lst: Iterable[Any]) -> set[Any]:
        """Horovod's helper: the elements seen more than once."""
        seen: set[Any] = set()
        dups: set[Any] = set()
        for el in lst:
            (dups if el in seen else seen).add(el)
        return dups

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._opt!r}, buckets={len(self.buckets)})"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._handles:  # Horovod's: a loaded optimizer starts its step afresh
            self._passes = [0] * len(self._params)
            self._synchronized, self._should_synchronize = False, True
        self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if any(id(p) not in self._wrapped_params for p in params):
            # no gradient hook on them: their gradients would never be averaged
            raise NotImplementedError(
                "DistributedOptimizer.add_param_group: add the group to the optimizer "
                "before wrapping it")
        # the wrapped optimizer's own groups, which torch's constructor adds (_init_base)
        super().add_param_group(param_group)

    # --------------------------------------------------------------------- hooks
    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self._should_synchronize:
                return
            with self._lock:
                if self._count_pass(i):
                    self._exchange.gradient_ready(i)

        return hook

    # ----------------------------------------------------------------- public API
    def synchronize(self) -> None:
        """Finish every gradient allreduce of this step; ``p.grad`` then holds the result.
        On a rank outside the optimizer's process set: nothing (Horovod's)."""
        if not self._included:
            self._synchronized = True
            return
        exchange = self._exchange
        try:
            with self._lock:
                exchange.launch_rest()
            exchange.wait()
        finally:
            self._passes = [0] * len(self._params)
            exchange.end_step()
        self._synchronized = True
        if exchange.replan_due:
            # Every running rank gets here at the same step; the lowest running rank's
            # timing (rank 0's unless it has joined) decides for all, and ranks that have
            # joined adopt the same plan while serving, so the plans stay identical.
            self._adopt_plan(self._agreed(exchange.ready_offsets()))

    def _agreed(self, ready_offsets: np.ndarray) -> np.ndarray:
        """Every rank's copy of the timings the plan is made from."""
        if self._set_scope is None:
            return broadcast_plan(ready_offsets, self._join_index)
        # a set's ranks alone: its lowest rank's timings (join covers the global set only)
        offsets = np.ascontiguousarray(ready_offsets, dtype=np.float64)
        return np.asarray(C.broadcast(offsets, self.process_set.ranks[0],
                                      process_set=self.process_set))

    def _adopt_plan(self, ready_offsets: np.ndarray) -> None:
        """The agreed timings (also called by :mod:`ddl.hvd.join` on ranks that joined)."""
        self._exchange.replan(ready_offsets)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` without synchronizing: for when you called ``synchronize()`` yourself
        (e.g. to clip the averaged gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after "
                    "optimizer.synchronize(): gradients are allreduced twice this step",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return self._opt.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._exchange.in_flight:
            raise ddl.DDLError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): allreduces of this step's "
                "gradients are in flight"
            )
        self._opt.zero_grad(set_to_none=set_to_none)

    @property
    def buckets(self) -> list[fusion.Bucket]:
        """The current fusion plan (for inspection and tests)."""
        return self._exchange.buckets

    @property
    def exchange_modes(self) -> list[str | None]:
        """How the last ``synchronize()`` moved each bucket: the values of ``Exchange``
        (``"grads"``, ``"into"``, ``"buffer"``, ``"packed"``, ``"sparse"``), None for a
        bucket that did not run."""
        return [None if m is None else m.value for m in self._exchange.modes]

    def remove_hooks(self) -> None:
        """Detach from the parameters (the wrapper stops working)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


class DistributedAdasumOptimizer(AdasumDeltas, DistributedOptimizer):
    """What ``DistributedOptimizer(optimizer, ..., op=hvd.Adasum)`` returns on more than one
    rank (same arguments; Horovod's ``_DistributedAdasumOptimizer``): the step and the
    combining of :class:`~ddl.torch.adasum_optimizer.AdasumDeltas`, and still a
    ``DistributedOptimizer`` for ``isinstance``."""
