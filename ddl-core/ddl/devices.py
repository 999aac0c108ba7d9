"""Collectives on torch tensors that go to a device engine (NCCL for CUDA tensors) instead
of being staged through host memory for the host engines.

``DDL_DEVICE_ENGINE`` decides: ``auto`` sends CUDA tensors to NCCL when this torch has it
(otherwise they are staged through the host engines), ``nccl`` insists on it, ``host``
always stages, and ``gloo`` sends CPU torch tensors through the same per-line torch process
groups over Gloo, which is how the device path is tested without a GPU.

The engine is made at the first collective on such a tensor, inside the ordered job, so
every rank makes it at the same point of its sequence of collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import config, tensors
from .engines import device as devmod
from .errors import DDLConfigError
from .ops import ReduceOp, check_op
from .options import Options
from .topology import World


class DeviceRouter:
    def __init__(self, world: World, opts: Options, rendezvous: Callable[[], Any]):
        self.world = world
        self.opts = opts
        self._rendezvous = rendezvous
        self._engines: dict[str, devmod.DeviceEngine] = {}
        self.choice = config.get("DDL_DEVICE_ENGINE")
        if self.choice == "nccl" and world.size > 1:
            # insisting on NCCL where it cannot run is refused at init, on every rank, not
            # at a first CUDA tensor that can never come
            why = devmod.nccl_refusal()
            if why:
                raise DDLConfigError(f"DDL_DEVICE_ENGINE=nccl: {why}")

    # ---------------------------------------------------------------------- routing
    def backend_for(self, tensor: Any, op: ReduceOp | None = None) -> str | None:
        """The device backend that takes ``tensor``, or None for the host engines."""
        if self.world.size == 1 or self.choice == "host" or not tensors.is_torch(tensor):
            return None
        kind = tensor.device.type
        if self.choice == "gloo":
            backend = "gloo" if kind == "cpu" else None
        elif kind == "cuda":
            if devmod.available("nccl"):
                backend = "nccl"
            elif self.choice == "nccl":
                raise DDLConfigError("DDL_DEVICE_ENGINE=nccl but this torch has no NCCL")
            else:
                backend = None
        else:
            backend = None
        if backend is None:
            return None
        if not devmod.reducible(str(tensor.dtype).removeprefix("torch."), op):
            return None  # e.g. int16 or uint32 on NCCL: the host engines reduce those
        return backend

    def engine(self, backend: str) -> devmod.DeviceEngine:
        eng = self._engines.get(backend)
        if eng is None:
            eng = devmod.DeviceEngine(self.world, self.opts, self._rendezvous(), backend=backend,
                                      timeout=config.get("DDL_TIMEOUT"),
                                      chunk_bytes=config.get("DDL_CHUNK_BYTES"))
            self._engines[backend] = eng
        return eng

    def describe(self) -> str:
        return "; ".join(f"{b}: {e.describe()}" for b, e in self._engines.items())

    # -------------------------------------------------------------------- planning
    def _job(self, backend: str, t, body: Callable[[devmod.DeviceEngine], Any]):
        """Wrap ``body`` so it runs on ``t``'s device after the work the caller has queued
        on its current stream (the job may run on ddl's worker thread)."""
        import torch

        ready = None
        if t.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(t.device))

        def job():
            eng = self.engine(backend)
            if ready is None:
                return body(eng)
            with torch.cuda.device(t.device):
                torch.cuda.current_stream().wait_event(ready)
                return body(eng)

        return job

    def plan_allreduce(self, backend: str, tensor, op: ReduceOp, out, inplace: bool):
        t = tensor.detach()
        check_op(op, tensors.dtype_of(t))
        if out is not None and (out.dtype != t.dtype or out.numel() != t.numel()
                                or out.device != t.device):
            raise DDLConfigError(f"allreduce: out is {out.dtype}[{out.numel()}] on "
                                 f"{out.device} but the input is {t.dtype}[{t.numel()}] on "
                                 f"{t.device}")

        def body(eng):
            if inplace and t.is_contiguous():
                eng.allreduce(t, op)
                return tensor
            work = t.contiguous() if inplace else t.clone(memory_format=_contiguous())
            eng.allreduce(work, op)
            if inplace:
                t.copy_(work)
                return tensor
            if out is not None:
                out.detach().copy_(work.view(out.shape))
                return out
            return work

        return self._job(backend, t, body)

    def plan_fused_allreduce(self, backend: str, sources: list, out, op: ReduceOp):
        """The concatenation of ``sources`` (one device) allreduced into ``out``, or back
        into the sources: the device engines work on one buffer, so it is packed."""
        import torch

        ts = [s.detach() for s in sources]
        devices = {t.device for t in ts} | ({out.device} if out is not None else set())
        if len(devices) != 1:
            raise DDLConfigError(f"fused allreduce: the tensors are on several devices "
                                 f"({', '.join(sorted(map(str, devices)))})")
        check_op(op, tensors.dtype_of(ts[0]))

        def body(eng):
            flat = torch.cat([t.reshape(-1) for t in ts])
            eng.allreduce(flat, op)
            if out is not None:
                out.detach().view(-1).copy_(flat)
                return out
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view(t.shape))
                off += t.numel()
            return sources

        return self._job(backend, ts[0], body)

    def plan_broadcast(self, backend: str, tensor, root: int, inplace: bool):
        t = tensor.detach()

        def body(eng):
            work = t if inplace and t.is_contiguous() else t.clone(memory_format=_contiguous())
            eng.broadcast(work, root)
            if inplace and work is not t:
                t.copy_(work)
            return tensor if inplace else work

        return self._job(backend, t, body)

    def plan_allgather(self, backend: str, tensor, row_shape: tuple[int, ...], row: int):
        t = tensor.detach()

        def body(eng):
            holder = []

            def alloc(counts: list[int]):
                rows = sum(counts) // row if row else 0
                holder.append(t.new_empty((rows,) + row_shape))
                return holder[0].view(-1)

            eng.allgather(t.contiguous().view(-1), alloc)
            return holder[0]

        return self._job(backend, t, body)

    def plan_reduce_scatter(self, backend: str, tensor, op: ReduceOp, counts: list[int],
                            out_shape: tuple[int, ...]):
        t = tensor.detach()
        check_op(op, tensors.dtype_of(t))

        def body(eng):
            out = t.new_empty(out_shape)
            eng.reduce_scatter(t.contiguous(), out, op, counts)
            return out

        return self._job(backend, t, body)

    def close(self) -> None:
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()


def _contiguous():
    import torch

    return torch.contiguous_format
