"""The engine for tensors that live on an accelerator: NCCL process groups, one per line of
every grid dimension (inside a host too: NVLink and PCIe peer copies are NCCL's job, and
shared memory cannot hold device memory).

Groups are made from ddl's own rendezvous store (the one the Gloo engine uses), never
through ``init_process_group``, so the user's default group is untouched. The
multi-dimensional allreduce is the same schedule as on the host (reduce-scatter inward,
allreduce on the outermost dimension, allgather back) issued chunk by chunk from one thread:
each communicator runs on its own NCCL stream, so chunk i+1's intra-host reduce-scatter
overlaps chunk i's transfer across hosts without host threads.

The same code runs on CPU tensors with ``backend="gloo"``; that is how it is tested on
machines without a GPU (``DDL_DEVICE_ENGINE=gloo`` routes CPU torch tensors here).
"""

from __future__ import annotations

import datetime
from typing import Any

from .. import grid as gridmod
from ..algorithms.multidim import chunk_plan
from ..config import CHUNK_MIN
from ..errors import DDLConfigError
from ..ops import ReduceOp
from ..options import Options
from ..topology import World
from .torch_pg import PGCaller

# dtypes NCCL and Gloo reduce (torch names; bool and complex through the views of
# DeviceEngine._reducible); others are staged through the host engines.
_NATIVE = frozenset({"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32",
                     "int64", "bool", "complex64", "complex128"})


def reducible(dtype_name: str, op: ReduceOp | None) -> bool:
    """Whether the device engine takes this dtype and op."""
    if dtype_name not in _NATIVE:
        return False
    return not (dtype_name.startswith("complex") and op is ReduceOp.PRODUCT)


def _torch():
    import torch
    import torch.distributed as dist

    return torch, dist


def available(backend: str) -> bool:
    try:
        _, dist = _torch()
    except ImportError:
        return False
    if backend == "nccl":
        return dist.is_available() and dist.is_nccl_available()
    return dist.is_available() and dist.is_gloo_available()


def nccl_refusal() -> str | None:
    """Why the NCCL engine cannot run in this process (None: it can): no torch, a CPU
    build, a build without NCCL, or no CUDA GPU visible (a CUDA build runs on the CPU)."""
    try:
        torch, dist = _torch()
    except ImportError:
        return "torch is not installed"
    if not torch.version.cuda:
        return f"torch {torch.__version__} is a CPU build"
    if not (dist.is_available() and dist.is_nccl_available()):
        return f"torch {torch.__version__} has no NCCL"
    if not torch.cuda.is_available():
        return (f"no CUDA GPU is visible (torch {torch.__version__}, a CUDA "
                f"{torch.version.cuda} build; torch.cuda.device_count() == 0)")
    return None


class DeviceGroup:
    """One torch process group (NCCL or Gloo) over a grid line, taking torch tensors."""

    def __init__(self, store, backend: str, name: str, members: tuple[int, ...],
                 position: int, timeout: float):
        torch, dist = _torch()
        self._torch, self._dist = torch, dist
        self.backend = backend
        self.members = members
        self.size = len(members)
        self.rank = position
        self.label = name
        prefix = dist.PrefixStore(f"ddl/dev/{backend}/{name}/", store)
        td = datetime.timedelta(seconds=max(timeout, 1.0))
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = td
            pg = dist.ProcessGroupNCCL(prefix, position, self.size, opts)
        else:
            pg = dist.ProcessGroupGloo(prefix, position, self.size, td)
        self._calls = PGCaller(pg, members[position],
                               f"{backend} group {name} (ranks {list(members)})",
                               shutdown=backend == "nccl")
        self._ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
                     ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}

    def allreduce(self, t, op: ReduceOp) -> None:
        if t.numel() == 0:
            return
        opts = self._dist.AllreduceOptions()
        opts.reduceOp = self._ops[op]
        self._calls.run(f"allreduce({t.dtype}[{t.numel()}])", lambda pg: pg.allreduce([t], opts))

    def reduce_scatter(self, out, inp, op: ReduceOp) -> None:
        """Equal blocks: out = this rank's block of the reduction of inp."""
        opts = self._dist.ReduceScatterOptions()
        opts.reduceOp = self._ops[op]
        self._calls.run(f"reduce_scatter({inp.dtype}[{inp.numel()}])",
                        lambda pg: pg._reduce_scatter_base(out, inp, opts))

    def allgather(self, out, inp) -> None:
        """Equal blocks: out = concat over the group of inp."""
        self._calls.run(f"allgather({inp.dtype}[{inp.numel()}])",
                        lambda pg: pg._allgather_base(out, inp))

    def broadcast(self, t, root: int) -> None:
        opts = self._dist.BroadcastOptions()
        opts.rootRank = root
        self._calls.run(f"broadcast({t.dtype}[{t.numel()}])", lambda pg: pg.broadcast([t], opts))

    def close(self) -> None:
        self._calls.close()


class DeviceDim:
    """One grid dimension on a DeviceGroup: the engine's own collectives (NCCL's rings and
    trees), with unequal blocks handled by a full allreduce or padding."""

    def __init__(self, group: DeviceGroup, index: int):
        self.group = group
        self.index = index
        self.size = group.size
        self.rank = group.rank

    def describe(self) -> str:
        return f"dim{self.index} x{self.size} {self.group.backend}"

    def reduce_scatter(self, buf, counts: list[int], op: ReduceOp) -> None:
        if len(set(counts)) != 1:
            self.group.allreduce(buf, op)  # every block reduced; ours is what counts
            return
        c = counts[0]
        mine = buf.new_empty(c)
        self.group.reduce_scatter(mine, buf, op)
        buf[c * self.rank : c * (self.rank + 1)].copy_(mine)

    def allgather(self, buf, counts: list[int]) -> None:
        m = max(counts)
        o = sum(counts[: self.rank])
        mine = buf.new_zeros(m)
        mine[: counts[self.rank]].copy_(buf[o : o + counts[self.rank]])
        if len(set(counts)) == 1:
            self.group.allgather(buf, mine)
            return
        out = buf.new_empty(m * self.size)
        self.group.allgather(out, mine)
        o = 0
        for i, c in enumerate(counts):
            buf[o : o + c].copy_(out[i * m : i * m + c])
            o += c

    def allreduce(self, buf, op: ReduceOp) -> None:
        self.group.allreduce(buf, op)


class DeviceEngine:
    """Collectives on torch tensors of one device type, over per-line process groups (an
    ``engines.base.TensorEngine``)."""

    def __init__(self, world: World, opts: Options, store, *, backend: str, timeout: float,
                 chunk_bytes: int):
        if not available(backend):
            raise DDLConfigError(f"the {backend} engine is not available in this torch build")
        self.backend = backend
        self.name = f"ddl/{backend}"
        self.rank, self.size = world.rank, world.size
        self.chunk_bytes = max(CHUNK_MIN, chunk_bytes)
        self.grid = gridmod.plan(world.rank, world.size, world.local_size, opts)
        self.dims = [DeviceDim(DeviceGroup(store, backend, f"d{d.index}l{d.line_id}",
                                           d.members, d.position, timeout), d.index)
                     for d in self.grid.dims if d.size > 1]
        self.world_group = DeviceGroup(store, backend, "world", tuple(range(world.size)),
                                       world.rank, timeout)

    def describe(self) -> str:
        return " -> ".join(d.describe() for d in self.dims) or "single rank"

    # --------------------------------------------------------------------- helpers
    def _reducible(self, t, op: ReduceOp) -> tuple[Any, ReduceOp]:
        """A flat view the process groups can reduce and the op to reduce it with: bool is
        logical (Sum = or, Product = and, like numpy), complex sums as pairs of reals."""
        torch = self._torch()
        flat = t.view(-1)
        if t.dtype == torch.bool:
            flat = flat.view(torch.uint8)
            op = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN}.get(op, op)
        elif t.is_complex():
            flat = torch.view_as_real(flat).view(-1)
        return flat, op

    @staticmethod
    def _torch():
        return _torch()[0]

    def _finish(self) -> None:
        """Block the calling (worker) thread until the device has the result, so a finished
        handle means a finished result; the user's stream order is kept either way."""
        torch = self._torch()
        if self.backend == "nccl":
            torch.cuda.current_stream().synchronize()

    # ----------------------------------------------------------------- collectives
    def allreduce(self, t, op: ReduceOp) -> None:
        """In place on a contiguous tensor; Average divides once at the end."""
        inner = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
        flat, inner = self._reducible(t, inner)
        if len(self.dims) == 1:
            self.dims[0].allreduce(flat, inner)
        elif self.dims:
            self._pipeline(flat, inner)
        if op is ReduceOp.AVERAGE and self.size > 1:
            t.div_(self.size)
        self._finish()

    def _pipeline(self, flat, op: ReduceOp) -> None:
        k = len(self.dims)
        for segs in chunk_plan(flat.numel(), self.dims, self.chunk_bytes // flat.element_size()):
            views = [flat[a:b] for a, b, _ in segs]
            for j in range(k - 1):
                self.dims[j].reduce_scatter(views[j], segs[j][2], op)
            self.dims[-1].allreduce(views[-1], op)
            for j in reversed(range(k - 1)):
                self.dims[j].allgather(views[j], segs[j][2])

    def _wire(self, t):
        """A flat view of ``t`` in a dtype every backend moves (for copies, not reductions)."""
        torch = self._torch()
        flat = t.reshape(-1)
        if t.dtype == torch.bool:
            return flat.view(torch.uint8)
        return torch.view_as_real(flat).view(-1) if t.is_complex() else flat

    def broadcast(self, t, root: int) -> None:
        if t.numel():
            self.world_group.broadcast(self._wire(t), root)
        self._finish()

    def allgather(self, t, alloc) -> Any:
        """Concatenate every rank's flat ``t``; ``alloc(counts)`` gives the flat output."""
        torch = self._torch()
        g = self.world_group
        sizes = torch.zeros(self.size, dtype=torch.int64, device=t.device)
        g.allgather(sizes, torch.tensor([t.numel()], dtype=torch.int64, device=t.device))
        counts = sizes.tolist()
        out = alloc(counts)
        m = max(counts)
        if m:
            padded = t.new_zeros(m)
            padded[: t.numel()].copy_(t.view(-1))
            gathered = t.new_empty(m * self.size)
            g.allgather(self._wire(gathered), self._wire(padded))
            o = 0
            for i, c in enumerate(counts):
                out[o : o + c].copy_(gathered[i * m : i * m + c])
                o += c
        self._finish()
        return out

    def reduce_scatter(self, t, out, op: ReduceOp, counts: list[int]) -> None:
        """``out`` = this rank's block (``counts``) of the reduction of flat ``t``."""
        inner = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
        src, inner = self._reducible(t.reshape(-1), inner)
        if len(set(counts)) == 1:
            dst, _ = self._reducible(out.reshape(-1), inner)
            self.world_group.reduce_scatter(dst, src, inner)
        else:
            work = t.reshape(-1).clone()
            self.allreduce(work, inner)
            o = sum(counts[: self.rank])
            out.view(-1).copy_(work[o : o + counts[self.rank]])
        if op is ReduceOp.AVERAGE:
            out.div_(self.size)
        self._finish()

    def close(self) -> None:
        for g in [d.group for d in self.dims] + [self.world_group]:
            g.close()
