"""Horovod's ``DistributedOptimizer`` on the ddl core.

Each parameter gets a post-accumulate-grad hook. When every gradient of a fusion bucket is
ready (after ``backward_passes_per_step`` passes), the bucket is packed (and compressed) into
its fusion buffer and its allreduce is queued (asynchronously, in place), so
communication overlaps the rest of backward. ``synchronize()`` (called by ``step()``)
launches what is left, waits, and unpacks the averaged gradients into ``p.grad``.

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
import dataclasses
import enum
import functools
import logging
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

import ddl
from ddl import timeline as _tl
from ddl.hvd import fusion
from ddl.hvd.adasum import is_adasum
from ddl.hvd.collectives import check_process_set, resolve_op, submit_allreduce
from ddl.hvd.compression import Compression, Compressor, cast_only, passthrough
from ddl.hvd.join import broadcast_plan, register_optimizer
from ddl.hvd.negotiate import ALLREDUCE, Handle, fail_here
from ddl.hvd.settings import cycle_time_ms as _default_cycle_ms
from ddl.hvd.settings import fusion_threshold_bytes as _default_threshold

from .mpi_ops import sparse_allreduce_async

_NUMPY = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32,
    torch.int64: np.int64, torch.bool: np.bool_, torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}

_log = logging.getLogger("ddl")

# Rank 0 times the hooks of this many steps' backward passes before the plan is refined
# (the first step carries one-off costs: allocator warm-up, lazy module init).
_REPLAN_AFTER_STEPS = 2


def _buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat fusion buffer. On the CPU it lives in ddl's shared memory (``ddl.malloc``), so
    the allreduce reads and writes it in place instead of staging copies."""
    if device.type == "cpu" and ddl.is_initialized():
        try:
            if dtype == torch.bfloat16:
                return torch.from_numpy(ddl.malloc((numel,), np.uint16)).view(torch.bfloat16)
            if dtype in _NUMPY:
                return torch.from_numpy(ddl.malloc((numel,), _NUMPY[dtype]))
        except ddl.DDLError as exc:
            # heap exhausted or unusable: an ordinary buffer gives the same sums, only the
            # allreduce stages copies of it, so training goes on, slower, and says why
            _log.warning("ddl.torch: a %d-element %s fusion buffer is not in ddl's shared "
                         "memory (%s); using an ordinary one, which the allreduce copies "
                         "through staging (slower; raise DDL_SHM_HEAP_BYTES)", numel, dtype, exc)
    return torch.empty(numel, dtype=dtype, device=device)


@dataclasses.dataclass
class _Step:
    """What one step's exchange has done so far (reset by every ``synchronize()``)."""

    counts: list[int]  # per parameter: backward passes whose gradient reached its hook
    waiting: list[int]  # per bucket: members whose gradient is not ready yet
    handles: list[Any]  # per bucket: its allreduce's Handle, once launched
    ctx: dict[int, Any]  # per parameter: the compressor's context for decompress
    next: int = 0  # the next bucket to launch: launches go strictly in plan order
    # buckets with sparse gradients: {member: its sparse handle}, and (bucket, buffer) of
    # the dense rest or None
    sparse_parts: dict[int, tuple[dict[int, Any], Any]] = dataclasses.field(
        default_factory=dict)

    @classmethod
    def start(cls, params: int, plan: Sequence[fusion.Bucket]) -> _Step:
        return cls(counts=[0] * params, waiting=[len(b.members) for b in plan],
                   handles=[None] * len(plan), ctx={})


class Exchange(str, enum.Enum):
    """How a bucket's gradients went to its allreduce (``exchange_modes()``; equal to the
    strings of the same value)."""

    GRADS = "grads"  # reduced in place where the gradients live
    INTO = "into"  # summed into the fusion buffer, whose views become the gradients
    BUFFER = "buffer"  # the gradients were those views already: reduced in the buffer
    PACKED = "packed"  # copied, cast or compressed into the buffer
    SPARSE = "sparse"  # sparse gradients allgathered, the dense rest packed


def checked_arguments(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None,
                      process_set: Any, backward_passes_per_step: int, set_refusal: str
                      ) -> list[tuple[str, torch.Tensor]]:
    """What every DistributedOptimizer checks first, in Horovod's order (its ValueErrors
    before anything else), and (name, param) for every parameter of ``optimizer``; a
    non-global ``process_set`` raises NotImplementedError(``set_refusal``)."""
    named = _named(optimizer, named_parameters)
    if check_process_set(process_set).group is not None:
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


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Same arguments as ``horovod.torch.DistributedOptimizer``, plus the fusion settings:
    ``fusion_threshold_bytes`` (default ``DDL_FUSION_THRESHOLD``, 128 MiB; 0 disables
    fusion) and ``cycle_time_ms`` (default ``DDL_CYCLE_TIME``, 1 ms; 0 keeps the
    size-only plan). The wrapper shares ``param_groups``/``state`` with ``optimizer``, so LR
    schedulers and checkpoints work on either.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> DistributedOptimizer:
        # Horovod's factory: op=hvd.Adasum on more than one rank gets the delta-combining
        # optimizer (a subclass, so Python then runs its __init__ with these arguments).
        op = args[4] if len(args) > 4 else kwargs.get("op")
        if cls is DistributedOptimizer and is_adasum(op) and ddl.is_initialized() and (
                ddl.size() > 1):
            from .adasum_optimizer import DistributedAdasumOptimizer

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
    ) -> None:
        # Argument errors first, as Horovod raises them (ValueError) before anything else
        named = checked_arguments(
            optimizer, named_parameters, process_set, backward_passes_per_step,
            "ddl.torch.DistributedOptimizer: process_set must be the global one (its "
            "buckets and join run over every rank); reduce a sub-set's gradients with "
            "hvd.grouped_allreduce(..., process_set=...) instead")
        # Adasum of one rank's delta is that delta: the plain optimizer, as in Horovod
        op = ddl.Average if is_adasum(op) else resolve_op(None, op)
        if gradient_predivide_factor != 1.0 and op is not ddl.Average:
            raise ddl.DDLConfigError("gradient_predivide_factor needs op=Average")
        if num_groups and groups is not None:
            raise ddl.DDLConfigError("pass num_groups or groups, not both")
        self._init_optimizer_base()
        self._opt = optimizer
        self._compression = compression
        self._bpps = backward_passes_per_step
        self._sparse_as_dense = sparse_as_dense
        self._sparse_op = op  # sparse gradients: Horovod's op, never the predivide split
        # Horovod's predivide: sum (grad / f) then scale by f / size, which is an average
        # computed with smaller intermediate values (fp16 overflow).
        if gradient_predivide_factor != 1.0:
            self._op = ddl.Sum
            self._prescale = 1.0 / gradient_predivide_factor
            self._postscale = gradient_predivide_factor / ddl.size()
        else:
            self._op, self._prescale, self._postscale = op, 1.0, 1.0
        self._threshold = (_default_threshold() if fusion_threshold_bytes is None
                           else int(fusion_threshold_bytes))
        self._cycle_s = (_default_cycle_ms() if cycle_time_ms is None
                         else float(cycle_time_ms)) / 1000.0
        self._names = [n for n, p in named if p.requires_grad]
        self._params = [p for _, p in named if p.requires_grad]  # frozen ones never sync
        self._index = {id(p): i for i, p in enumerate(self._params)}
        # Plain copies are exact and need no temporary for the built-in compressors.
        self._fast = cast_only(compression)
        # gradients go to the allreduce as they are: no cast, no scaling before the sum
        self._direct = passthrough(compression) and self._prescale == 1.0
        self._keys = [self._key(p) for p in self._params]
        self._numels = [p.numel() for p in self._params]
        self._itemsizes = [torch.empty(0, dtype=k[0]).element_size() for k in self._keys]
        self._fixed_groups = self._explicit_groups(num_groups, groups)
        self._lock = threading.Lock()
        self._set_plan(self._initial_plan())
        self._ready_at = [float("nan")] * len(self._params)
        self._steps = 0
        self._replanned = self._fixed_groups is not None or self._cycle_s <= 0
        self._should_synchronize = True
        self._synchronized = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self._params)]
        self._join_index = register_optimizer(self)

    # ------------------------------------------------------------------ plumbing
    def _init_optimizer_base(self) -> None:
        # torch.optim.Optimizer.__init__ would build param groups of its own; the wrapper
        # shares the wrapped optimizer's instead (see the properties), so only the hook
        # tables the base class uses are set up here.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

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

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._opt!r}, buckets={len(self._plan)})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer cannot be pickled; save optimizer.state_dict()")

    def _key(self, p: torch.Tensor) -> tuple[torch.dtype, str]:
        if passthrough(self._compression):
            dtype = p.dtype
        else:  # the wire dtype: what the compressor makes of an empty tensor of this kind
            dtype = self._compression.compress(torch.empty(0, dtype=p.dtype,
                                                           device=p.device))[0].dtype
        return dtype, str(p.device)

    def _explicit_groups(self, num_groups: int, groups: Sequence[Sequence[torch.Tensor]] | None
                         ) -> list[list[int]] | None:
        if num_groups:
            return fusion.split_evenly(len(self._params), num_groups)
        if groups is None:
            return None
        out, seen = [], set()
        for g in groups:
            idx = []
            for p in g:
                i = self._index.get(id(p))
                if i is None:
                    raise ddl.DDLConfigError("groups contains a tensor that is not a trainable "
                                             "parameter of the optimizer")
                idx.append(i)
            seen.update(idx)
            out.append(idx)
        rest = [i for i in range(len(self._params)) if i not in seen]
        if rest:  # Horovod: parameters outside every group are reduced one by one
            out.extend([i] for i in rest)
        return out

    def _initial_plan(self) -> list[fusion.Bucket]:
        if self._fixed_groups is not None:
            return fusion.plan_groups(self._fixed_groups, self._numels, self._keys)
        return fusion.plan_buckets(self._numels, self._itemsizes, self._keys, self._threshold)

    def _set_plan(self, plan: list[fusion.Bucket]) -> None:
        self._plan = plan
        self._bucket_of = [0] * len(self._params)
        for b, bucket in enumerate(plan):
            for i in bucket.members:
                self._bucket_of[i] = b
        self._buffers: list[torch.Tensor | None] = [None] * len(plan)
        # per bucket: the gradients of its last direct allreduce (weakly: to tell gradients
        # kept across steps from fresh ones) and where that allreduce put its sums
        self._kept: list[list[weakref.ref]] = [[] for _ in plan]
        self._direct_mode: list[Exchange | None] = [None] * len(plan)
        self._last_modes: list[Exchange | None] = []
        self._reset_step()

    def _reset_step(self) -> None:
        self._this_step = _Step.start(len(self._params), self._plan)

    # --------------------------------------------------------------------- hooks
    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if not self._should_synchronize:
                return
            with self._lock:
                self._this_step.counts[i] += 1
                if self._this_step.counts[i] > self._bpps:
                    raise too_many_passes(self._names[i], self._bpps)
                if self._this_step.counts[i] < self._bpps:
                    return
                self._ready_at[i] = time.perf_counter()
                b, step = self._bucket_of[i], self._this_step
                step.waiting[b] -= 1
                while step.next < len(self._plan) and step.waiting[step.next] == 0:
                    self._launch(step.next)
                    step.next += 1

        return hook

    def _launch(self, b: int, inline: bool = False) -> None:
        """Start bucket ``b``'s exchange: queued for ddl's worker from a gradient hook, or
        ``inline`` from synchronize(), which waits at once (see ``_submit``)."""
        bucket = self._plan[b]
        dtype, device = bucket.key
        name = f"grad.bucket{b}"
        try:
            grads = self._grads(bucket)
        except Exception as exc:
            # the bucket's allreduce still takes part in the exchange, so the other ranks'
            # raises too instead of waiting for this one
            fail_here(ALLREDUCE, exc, name, async_=not inline)
            raise
        if any(g.is_sparse for g in grads):
            self._launch_sparse(b, bucket, grads, name, inline)
            return
        if device == "cpu" and self._direct and all(g.dtype == dtype for g in grads):
            self._launch_direct(b, bucket, grads, name, inline)
            return
        buf = self._buffer(b)
        self._direct_mode[b] = Exchange.PACKED
        pack = functools.partial(self._pack, b, bucket, buf, grads)
        if buf.device.type == "cpu":
            # Copied in on ddl's worker thread, as Horovod's background thread does: the
            # thread running backward only queues, and the copy runs right before the
            # allreduce, in the same order on every rank.
            before = pack
        else:
            pack()  # on the caller's CUDA stream, which the collective then waits for
            before = None
        self._submit(b, inline, buf, name=name, inplace=True, prescale=self._prescale,
                     postscale=self._postscale, before=before)

    def _launch_sparse(self, b: int, bucket: fusion.Bucket, grads: list, name: str,
                       inline: bool) -> None:
        """A bucket holding sparse gradients (``nn.Embedding(sparse=True)`` without
        ``sparse_as_dense``), reduced as Horovod reduces them: each sparse one as the
        allgather of its indices and values (``sparse_allreduce_async``: Average divides
        the values by ``size()``), in member order; then the dense rest, packed into a
        bucket of their own. Every rank must have the same gradients sparse: a rank whose
        gradient is dense issues another call, which the exchange reports on every rank."""
        self._direct_mode[b] = Exchange.SPARSE
        self._kept[b] = []
        sparse = {i: sparse_allreduce_async(g, op=self._sparse_op)
                  for i, g in zip(bucket.members, grads) if g.is_sparse}
        dense = [(i, g) for i, g in zip(bucket.members, grads) if not g.is_sparse]
        rest = None
        if dense:
            rest = fusion.plan_groups([[i for i, _ in dense]], self._numels,
                                      [bucket.key] * len(self._numels))[0]
            dtype, device = bucket.key
            buf = _buffer(rest.numel, dtype, torch.device(device))
            pack = functools.partial(self._pack, b, rest, buf, [g for _, g in dense])
            if buf.device.type == "cpu":
                before = pack
            else:
                pack()
                before = None
            self._submit(b, inline, buf, name=name, inplace=True, prescale=self._prescale,
                         postscale=self._postscale, before=before)
            rest = (rest, buf)
        else:
            self._this_step.handles[b] = Handle.ready(None)
        self._this_step.sparse_parts[b] = (sparse, rest)

    def _grads(self, bucket: fusion.Bucket) -> list[torch.Tensor]:
        grads = []
        with torch.no_grad():
            for i in bucket.members:
                p = self._params[i]
                g = p.grad
                if g is None:
                    # Unused on this rank (or everywhere): contribute zeros, as Horovod does,
                    # so the peers' collective still matches.
                    g = p.grad = torch.zeros_like(p)
                elif g.is_sparse and self._sparse_as_dense:
                    g = p.grad = g.to_dense()
                grads.append(g)
        return grads

    def _buffer(self, b: int) -> torch.Tensor:
        buf = self._buffers[b]
        if buf is None:
            dtype, device = self._plan[b].key
            buf = self._buffers[b] = _buffer(self._plan[b].numel, dtype, torch.device(device))
        return buf

    def _launch_direct(self, b: int, bucket: fusion.Bucket, grads: list, name: str,
                       inline: bool) -> None:
        """CPU gradients sent as they are: never packed. Which memory the sum goes to
        depends on where the gradients live (all three are the same allreduce on the wire)."""
        buf = self._buffers[b]
        if buf is not None and self._in_place(bucket, buf, grads):
            # Accumulated straight into the shared buffer (zero_grad(set_to_none=False)
            # after a step that left views): peers read and write it in place, the cheapest.
            self._submit(b, inline, buf, name=name, inplace=True)
            self._direct_mode[b] = Exchange.BUFFER
        elif len(self._kept[b]) == len(grads) and all(r() is g
                                                      for r, g in zip(self._kept[b], grads)):
            # The same gradient tensors as last step (kept, not reset): sum them into the
            # buffer once and hand out views of it, so later steps take the branch above.
            buf = self._buffer(b)
            self._submit(b, inline, buf, name=name, sources=grads)
            self._direct_mode[b] = Exchange.INTO
        else:
            # Fresh gradients (zero_grad(set_to_none=True), the default): reduced in place,
            # each staged from where it lives; the buffer is not even needed for that.
            self._submit(b, inline, self._stand_in(bucket), name=name, inplace=True,
                         sources=grads)
            self._direct_mode[b] = Exchange.GRADS
        self._kept[b] = [weakref.ref(g) for g in grads]

    def _submit(self, b: int, inline: bool, tensor: torch.Tensor, **kw: Any) -> None:
        if inline:
            # from synchronize(), which waits at once: run on this thread when ddl has
            # nothing queued, as blocking calls do (no hand-off to and from the worker)
            self._this_step.handles[b] = Handle.ready(
                submit_allreduce(tensor, self._op, async_=False, **kw))
        else:
            self._this_step.handles[b] = submit_allreduce(tensor, self._op, **kw)

    @staticmethod
    def _stand_in(bucket: fusion.Bucket) -> torch.Tensor:
        """What the bucket's fusion buffer looks like, without its memory (for the join
        descriptor, which ranks that joined answer with zeros of that shape)."""
        return torch.empty(bucket.numel, dtype=bucket.key[0], device="meta")

    def _in_place(self, bucket: fusion.Bucket, buf: torch.Tensor, grads: list) -> bool:
        base, isz = buf.data_ptr(), buf.element_size()
        return all(g.data_ptr() == base + off * isz and g.is_contiguous()
                   for off, g in zip(bucket.offsets, grads))

    def _pack(self, b: int, bucket: fusion.Bucket, buf: torch.Tensor, grads: list) -> None:
        with _tl.span("pack", "fusion", {"bucket": b, "elements": bucket.numel}), \
                torch.no_grad():
            for i, off, g in zip(bucket.members, bucket.offsets, grads):
                dst = buf[off:off + self._numels[i]]
                if self._fast:
                    if g.data_ptr() != dst.data_ptr():  # else: accumulated in place already
                        dst.copy_(g.reshape(-1))  # casts to float16 for Compression.fp16
                else:
                    c, self._this_step.ctx[i] = self._compression.compress(g)
                    dst.copy_(c.reshape(-1))
            if self._prescale != 1.0:
                buf.mul_(self._prescale)

    def _unpack(self, b: int) -> None:
        if self._direct_mode[b] is Exchange.GRADS:
            return  # the sums are in p.grad already
        if self._direct_mode[b] is Exchange.SPARSE:
            sparse, rest = self._this_step.sparse_parts[b]
            for i, h in sparse.items():
                self._params[i].grad = h.wait()  # coalesced, summed or averaged
            if rest is not None:
                self._copy_out(b, *rest)
            return
        self._copy_out(b, self._plan[b], self._buffers[b])

    def _copy_out(self, b: int, bucket: fusion.Bucket, buf: torch.Tensor) -> None:
        with _tl.span("unpack", "fusion", {"bucket": b, "elements": bucket.numel}), \
                torch.no_grad():
            if self._postscale != 1.0:
                buf.mul_(self._postscale)
            for i, off in zip(bucket.members, bucket.offsets):
                p = self._params[i]
                src = buf[off:off + self._numels[i]].view(p.shape)
                if self._fast and src.dtype == p.dtype and src.device == p.device:
                    # The averaged gradient becomes a view of the fusion buffer (DDP's
                    # gradient_as_bucket_view): no copy out, and a backward that accumulates
                    # into it writes straight into the buffer for the next exchange.
                    p.grad = src
                elif self._fast:
                    p.grad.copy_(src)
                else:
                    p.grad.copy_(self._compression.decompress(src, self._this_step.ctx.get(i)))

    # ----------------------------------------------------------------- public API
    def synchronize(self) -> None:
        """Finish every gradient allreduce of this step; ``p.grad`` then holds the result."""
        try:
            with self._lock:
                while self._this_step.next < len(self._plan):
                    self._launch(self._this_step.next, inline=True)
                    self._this_step.next += 1
            for b, h in enumerate(self._this_step.handles):
                h.wait()
                self._unpack(b)
        finally:
            ready = list(self._ready_at)
            self._last_modes = list(self._direct_mode)
            self._reset_step()
        self._synchronized = True
        self._steps += 1
        if not self._replanned and self._steps >= _REPLAN_AFTER_STEPS:
            self._replan(ready)

    def _replan(self, ready: list[float]) -> None:
        # Every running rank gets here at the same step; the lowest running rank's timing
        # (rank 0's unless it has joined) decides for all, and ranks that have joined adopt
        # the same plan while serving, so the plans stay identical.
        t = np.asarray(ready, dtype=np.float64)
        known = t[np.isfinite(t)]
        if known.size:
            t = np.where(np.isfinite(t), t - known.min(), known.max() - known.min() + 1.0)
        else:
            t = np.zeros_like(t)
        self._adopt_plan(broadcast_plan(t, self._join_index))

    def _adopt_plan(self, t: np.ndarray) -> None:
        self._replanned = True
        plan = fusion.plan_buckets(self._numels, self._itemsizes, self._keys, self._threshold,
                                   ready_times=t.tolist(), cycle_time_s=self._cycle_s)
        if plan != self._plan:
            self._set_plan(plan)

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
        if any(h is not None for h in self._this_step.handles):
            raise ddl.DDLError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): allreduces of this step's "
                "gradients are in flight"
            )
        self._opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "DistributedOptimizer.add_param_group: add the group to the optimizer before "
            "wrapping it"
        )

    @property
    def buckets(self) -> list[fusion.Bucket]:
        """The current fusion plan (for inspection and tests)."""
        return list(self._plan)

    @property
    def exchange_modes(self) -> list[str | None]:
        """How the last ``synchronize()`` moved each bucket: the values of ``Exchange``
        (``"grads"``, ``"into"``, ``"buffer"``, ``"packed"``, ``"sparse"``), None for a
        bucket that did not run."""
        return [None if m is None else m.value for m in self._last_modes]

    def remove_hooks(self) -> None:
        """Detach from the parameters (the wrapper stops working)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
