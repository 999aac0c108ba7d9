"""The DistributedOptimizer's gradient exchange, one fusion bucket at a time.

A :class:`BucketExchange` holds what moves a step's gradients between ranks: the fusion plan
(:mod:`ddl.hvd.fusion`, pure and framework-free), the fusion buffers, the choice between
reducing gradients where they live and packing them into a buffer, the launch of each
bucket's allreduce strictly in plan order, the copy back into ``p.grad``, and the one-time
replanning from the hooks' timings. It packs torch tensors, so it is torch-side; the
optimizer keeps torch.optim's plumbing, the gradient hooks and ``step()``/``synchronize()``,
and tells the exchange when a gradient is final.

Not thread-safe by itself: the optimizer calls ``gradient_ready`` and ``launch_rest`` under
its lock (gradient hooks can run on autograd's device threads).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import ddl
from ddl import timeline as _tl
from ddl.hvd import fusion
from ddl.hvd import negotiate as ng
from ddl.hvd.collectives import submit_allreduce
from ddl.hvd.compression import Compressor, cast_only, passthrough
from ddl.hvd.negotiate import ALLREDUCE, Handle, fail_here

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
REPLAN_AFTER_STEPS = 2


def fusion_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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


def wire_key(compression: type[Compressor], p: torch.Tensor) -> tuple[torch.dtype, str]:
    """What a gradient of ``p`` must share with others to share a buffer: the dtype it is
    sent in (what the compressor makes of an empty tensor of its kind) and its device."""
    if passthrough(compression):
        dtype = p.dtype
    else:
        dtype = compression.compress(torch.empty(0, dtype=p.dtype, device=p.device))[0].dtype
    return dtype, str(p.device)


class Exchange(str, enum.Enum):
    """How a bucket's gradients went to its allreduce (``exchange_modes()``; equal to the
    strings of the same value)."""

    GRADS = "grads"  # reduced in place where the gradients live
    INTO = "into"  # summed into the fusion buffer, whose views become the gradients
    BUFFER = "buffer"  # the gradients were those views already: reduced in the buffer
    PACKED = "packed"  # copied, cast or compressed into the buffer
    SPARSE = "sparse"  # sparse gradients allgathered, the dense rest packed


@dataclasses.dataclass
class _Step:
    """What one step's exchange has done so far (reset at the end of every step)."""

    waiting: list[int]  # per bucket: members whose gradient is not ready yet
    handles: list[Any]  # per bucket: its allreduce's Handle, once launched
    ctx: dict[int, Any]  # per parameter: the compressor's context for decompress
    next: int = 0  # the next bucket to launch: launches go strictly in plan order
    # buckets with sparse gradients: {member: its sparse handle}, and (bucket, buffer) of
    # the dense rest or None
    sparse_parts: dict[int, tuple[dict[int, Any], Any]] = dataclasses.field(
        default_factory=dict)
    # parameters whose sparse gradient went dense for the exchange (``sparse_as_dense``):
    # made sparse again once reduced, as Horovod does, for optimizers that take only sparse
    densified: dict[int, int] = dataclasses.field(default_factory=dict)  # -> sparse_dim

    @classmethod
    def start(cls, plan: Sequence[fusion.Bucket]) -> _Step:
        return cls(waiting=[len(b.members) for b in plan], handles=[None] * len(plan), ctx={})


class BucketExchange:
    """The fusion buckets of ``params``' gradients and their allreduces, step after step.

    ``op`` with ``predivide`` (Horovod's ``gradient_predivide_factor``, which needs
    ``op=Average``) sets how dense gradients are reduced; sparse ones always go with
    ``op``. ``groups`` (lists of parameter indices) fixes the buckets for good; otherwise
    they are planned by size (``threshold_bytes``) and refined once from the hooks' timings
    (``cycle_time_s``; 0 keeps the size-only plan). ``scope`` (a process set's protocol
    state, None: the global set) and its ``process_set`` say whose gradients are reduced:
    every collective runs among that set's ranks, which alone use the exchange.
    """

    def __init__(self, params: Sequence[torch.Tensor], *, compression: type[Compressor],
                 op: Any, predivide: float, sparse_as_dense: bool, threshold_bytes: int,
                 cycle_time_s: float, groups: list[list[int]] | None,
                 scope: ng._State | None = None, process_set: Any = None) -> None:
        self._params = list(params)
        self._scope = scope
        self._process_set = process_set if scope is not None else None
        self._compression = compression
        self._sparse_op = op  # sparse gradients: Horovod's op, never the predivide split
        self._sparse_as_dense = sparse_as_dense
        # Horovod's predivide: sum (grad / f) then scale by f / size, which is an average
        # computed with smaller intermediate values (fp16 overflow).
        if predivide != 1.0:
            self._op, self._prescale, self._postscale = (
                ddl.Sum, 1.0 / predivide, predivide / self.size)
        else:
            self._op, self._prescale, self._postscale = op, 1.0, 1.0
        self._threshold = threshold_bytes
        self._cycle_s = cycle_time_s
        # Plain copies are exact and need no temporary for the built-in compressors.
        self._fast = cast_only(compression)
        # gradients go to the allreduce as they are: no cast, no scaling before the sum
        self._direct = passthrough(compression) and self._prescale == 1.0
        self._keys = [wire_key(compression, p) for p in self._params]
        self._numels = [p.numel() for p in self._params]
        self._itemsizes = [torch.empty(0, dtype=k[0]).element_size() for k in self._keys]
        self._ready_at = [float("nan")] * len(self._params)  # when each gradient was final
        self._steps = 0
        self.replanned = groups is not None or cycle_time_s <= 0
        self._last_modes: list[Exchange | None] = []
        if groups is not None:
            self._set_plan(fusion.plan_groups(groups, self._numels, self._keys))
        else:
            self._set_plan(fusion.plan_buckets(self._numels, self._itemsizes, self._keys,
                                               self._threshold))

    # ---------------------------------------------------------------- inspection
    @property
    def size(self) -> int:
        """How many ranks the gradients are reduced over (the process set's size)."""
        return ddl.size() if self._scope is None else self._scope.size

    @property
    def buckets(self) -> list[fusion.Bucket]:
        """The current plan, in launch order."""
        return list(self._plan)

    @property
    def modes(self) -> list[Exchange | None]:
        """How the last finished step moved each bucket (None: the bucket did not run)."""
        return list(self._last_modes)

    @property
    def in_flight(self) -> bool:
        """Whether this step has launched any bucket yet."""
        return any(h is not None for h in self._step.handles)

    # ---------------------------------------------------------------------- plan
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
        self._mode: list[Exchange | None] = [None] * len(plan)
        self._last_modes = []
        self._step = _Step.start(plan)

    @property
    def replan_due(self) -> bool:
        """Whether enough steps are timed to refine the plan (once; see ``ready_offsets``)."""
        return not self.replanned and self._steps >= REPLAN_AFTER_STEPS

    def ready_offsets(self) -> np.ndarray:
        """When each gradient was last final, from the first one (seconds); a gradient never
        seen comes after all the others."""
        t = np.asarray(self._ready_at, dtype=np.float64)
        known = t[np.isfinite(t)]
        if not known.size:
            return np.zeros_like(t)
        return np.where(np.isfinite(t), t - known.min(), known.max() - known.min() + 1.0)

    def replan(self, ready_offsets: np.ndarray) -> None:
        """Adopt the plan that the (agreed) ``ready_offsets`` give: every rank must call it
        with the same offsets at the same step, so the plans stay identical."""
        self.replanned = True
        plan = fusion.plan_buckets(self._numels, self._itemsizes, self._keys, self._threshold,
                                   ready_times=ready_offsets.tolist(),
                                   cycle_time_s=self._cycle_s)
        if plan != self._plan:
            self._set_plan(plan)

    # -------------------------------------------------------------------- launch
    def gradient_ready(self, i: int) -> None:
        """Parameter ``i``'s gradient is final for this step: launch every bucket, in plan
        order, that has all of its gradients now."""
        self._ready_at[i] = time.perf_counter()
        step = self._step
        step.waiting[self._bucket_of[i]] -= 1
        while step.next < len(self._plan) and step.waiting[step.next] == 0:
            self._launch(step.next)
            step.next += 1

    def launch_rest(self) -> None:
        """Launch, in plan order, every bucket not launched yet (whatever its gradients),
        on this thread: the caller waits for them at once."""
        step = self._step
        while step.next < len(self._plan):
            self._launch(step.next, inline=True)
            step.next += 1

    def _launch(self, b: int, inline: bool = False) -> None:
        """Start bucket ``b``'s exchange: queued for ddl's worker from a gradient hook, or
        ``inline`` from ``launch_rest``, which the caller waits for at once."""
        bucket = self._plan[b]
        dtype, device = bucket.key
        name = f"grad.bucket{b}"
        try:
            grads = self._grads(bucket)
        except Exception as exc:
            # the bucket's allreduce still takes part in the exchange, so the other ranks'
            # raises too instead of waiting for this one
            fail_here(ALLREDUCE, exc, name, async_=not inline, scope=self._scope)
            raise
        if any(g.is_sparse for g in grads):
            self._launch_sparse(b, bucket, grads, name, inline)
            return
        if device == "cpu" and self._direct and all(g.dtype == dtype for g in grads):
            self._launch_direct(b, bucket, grads, name, inline)
            return
        self._mode[b] = Exchange.PACKED
        self._launch_packed(b, bucket, self._buffer(b), grads, name, inline)

    def _launch_packed(self, b: int, bucket: fusion.Bucket, buf: torch.Tensor, grads: list,
                       name: str, inline: bool) -> None:
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
        self._mode[b] = Exchange.SPARSE
        self._kept[b] = []
        sparse = {i: sparse_allreduce_async(g, op=self._sparse_op,
                                            process_set=self._process_set)
                  for i, g in zip(bucket.members, grads) if g.is_sparse}
        dense = [(i, g) for i, g in zip(bucket.members, grads) if not g.is_sparse]
        rest = None
        if dense:
            rest_bucket = fusion.plan_groups([[i for i, _ in dense]], self._numels,
                                             [bucket.key] * len(self._numels))[0]
            dtype, device = bucket.key
            buf = fusion_buffer(rest_bucket.numel, dtype, torch.device(device))
            self._launch_packed(b, rest_bucket, buf, [g for _, g in dense], name, inline)
            rest = (rest_bucket, buf)
        else:
            self._step.handles[b] = Handle.ready(None)
        self._step.sparse_parts[b] = (sparse, rest)

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
                    self._step.densified[i] = g.sparse_dim()
                    g = p.grad = g.to_dense()
                grads.append(g)
        return grads

    def _buffer(self, b: int) -> torch.Tensor:
        buf = self._buffers[b]
        if buf is None:
            dtype, device = self._plan[b].key
            buf = self._buffers[b] = fusion_buffer(self._plan[b].numel, dtype,
                                                   torch.device(device))
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
            self._mode[b] = Exchange.BUFFER
        elif len(self._kept[b]) == len(grads) and all(r() is g
                                                      for r, g in zip(self._kept[b], grads)):
            # The same gradient tensors as last step (kept, not reset): sum them into the
            # buffer once and hand out views of it, so later steps take the branch above.
            buf = self._buffer(b)
            self._submit(b, inline, buf, name=name, sources=grads)
            self._mode[b] = Exchange.INTO
        else:
            # Fresh gradients (zero_grad(set_to_none=True), the default): reduced in place,
            # each staged from where it lives; the buffer is not even needed for that.
            self._submit(b, inline, self._stand_in(bucket), name=name, inplace=True,
                         sources=grads)
            self._mode[b] = Exchange.GRADS
        self._kept[b] = [weakref.ref(g) for g in grads]

    def _submit(self, b: int, inline: bool, tensor: torch.Tensor, **kw: Any) -> None:
        submit = functools.partial(submit_allreduce, scope=self._scope)
        if inline:
            # the caller waits at once: run on this thread when ddl has nothing queued, as
            # blocking calls do (no hand-off to and from the worker)
            self._step.handles[b] = Handle.ready(submit(tensor, self._op, async_=False, **kw))
        else:
            self._step.handles[b] = submit(tensor, self._op, **kw)

    def handles(self) -> dict[int, Any]:
        """This step's launched allreduces: {parameter index: its bucket's handle}."""
        out = {}
        for b, h in enumerate(self._step.handles):
            if h is not None:
                for i in self._plan[b].members:
                    out[i] = h
        return out

    @staticmethod
    def _stand_in(bucket: fusion.Bucket) -> torch.Tensor:
        """What the bucket's fusion buffer looks like, without its memory (for the join
        descriptor, which ranks that joined answer with zeros of that shape)."""
        return torch.empty(bucket.numel, dtype=bucket.key[0], device="meta")

    @staticmethod
    def _in_place(bucket: fusion.Bucket, buf: torch.Tensor, grads: list) -> bool:
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
                    c, self._step.ctx[i] = self._compression.compress(g)
                    dst.copy_(c.reshape(-1))
            if self._prescale != 1.0:
                buf.mul_(self._prescale)

    # -------------------------------------------------------------------- finish
    def wait(self) -> None:
        """Wait for every bucket of this step (all launched) and put the results in
        ``p.grad``; counts the step as timed."""
        for b, h in enumerate(self._step.handles):
            h.wait()
            self._unpack(b)
        with torch.no_grad():
            for i, sparse_dim in self._step.densified.items():
                p = self._params[i]  # the gradient's own layout (an embedding's: rows)
                p.grad = p.grad.to_sparse(sparse_dim)
        self._steps += 1

    def end_step(self) -> None:
        """Forget this step's progress (after ``wait``, or after it failed)."""
        self._last_modes = list(self._mode)
        self._step = _Step.start(self._plan)

    def _unpack(self, b: int) -> None:
        if self._mode[b] is Exchange.GRADS:
            return  # the sums are in p.grad already
        if self._mode[b] is Exchange.SPARSE:
            sparse, rest = self._step.sparse_parts[b]
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
                    p.grad.copy_(self._compression.decompress(src, self._step.ctx.get(i)))
