"""Cross-host engine on MPI (mpi4py), for jobs started by mpirun or srun: one
communicator per grid line, split from COMM_WORLD. Same surface as the Gloo groups."""

from __future__ import annotations

import zlib

import numpy as np

from ..dtypes import DType
from ..errors import DDLConfigError, DDLPeerError
from ..ops import ReduceOp

# MPI has no float16/bfloat16/bool reductions in the standard: ddl's ring does those. Nor
# 8- and 16-bit integers: Open MPI 5's AVX reductions saturate them (250 + 8 gave 255, not 2).
_NATIVE = {"int32", "uint32", "int64", "uint64", "float32", "float64", "complex64",
           "complex128"}


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError:
        raise DDLConfigError("the mpi engine needs mpi4py: pip install 'powerddl[mpi]'") from None
    return MPI


def all_ranks(mine: bool) -> bool:
    """Whether every rank of COMM_WORLD says yes (initialises MPI if it was not)."""
    MPI = _mpi()
    return bool(MPI.COMM_WORLD.allreduce(int(mine), op=MPI.MIN))


class MPIContext:
    """An ``engines.base.PeerContext``: groups split from COMM_WORLD."""

    def __init__(self) -> None:
        self.MPI = _mpi()
        self.world = self.MPI.COMM_WORLD
        # An exception in one rank must not leave the others in a collective forever.
        self.world.Set_errhandler(self.MPI.ERRORS_RETURN)

    def group(self, name: str, members: tuple[int, ...], position: int) -> MPIGroup:
        # Every rank of COMM_WORLD calls Split once per dimension (colour = line id), so
        # groups are made in the same order everywhere.
        comm = self.world.Split(color=members[0], key=position)
        return MPIGroup(self.MPI, comm, name, members, position)

    def subgroup(self, name: str, members: tuple[int, ...], position: int,
                 timeout: float) -> MPIGroup:
        """A group made by its members only (``ddl.new_group``): MPI_Comm_create_group,
        which has no timeout (``timeout`` is not applied)."""
        everyone = self.world.Get_group()
        mine = everyone.Incl(list(members))
        try:
            comm = self.world.Create_group(mine, tag=zlib.crc32(name.encode()) & 0x7FFF)
        finally:
            mine.Free()
            everyone.Free()
        return MPIGroup(self.MPI, comm, name, members, position)

    def close(self) -> None:
        """Nothing to leave: COMM_WORLD is the launcher's, each group frees its own."""


class MPIGroup:
    """An ``engines.base.PeerGroup`` over an MPI communicator."""

    name = "mpi"

    def __init__(self, MPI, comm, label: str, members: tuple[int, ...], position: int):
        self.MPI = MPI
        self.comm = comm
        self.label = label
        self.members = members
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.global_rank = members[position]
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVERAGE: MPI.SUM, ReduceOp.MIN: MPI.MIN,
                     ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}

    def _call(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except self.MPI.Exception as exc:
            raise DDLPeerError(f"rank {self.global_rank}: {what} on MPI group {self.label} "
                               f"(ranks {list(self.members)}) failed: {exc}") from None

    def native_ok(self, dt: DType) -> bool:
        return dt.name in _NATIVE

    def sendrecv(self, send: np.ndarray, to: int, recv: np.ndarray, frm: int) -> None:
        self._call("sendrecv", self.comm.Sendrecv, [send.view(np.uint8), self.MPI.BYTE], to, 0,
                   [recv.view(np.uint8), self.MPI.BYTE], frm, 0)

    def allreduce(self, buf: np.ndarray, dt: DType, op: ReduceOp) -> None:
        if buf.size == 0:
            return
        self._call("allreduce", self.comm.Allreduce, self.MPI.IN_PLACE, buf, self._ops[op])
        if op is ReduceOp.AVERAGE:
            np.divide(buf, self.size, out=buf, casting="unsafe")

    def broadcast(self, buf: np.ndarray, dt: DType, root: int) -> None:
        if buf.size:
            self._call("broadcast", self.comm.Bcast, [buf.view(np.uint8), self.MPI.BYTE], root)

    def allgather_bytes(self, src: np.ndarray, dst: np.ndarray) -> None:
        if dst.nbytes:
            self._call("allgather", self.comm.Allgather, [src.view(np.uint8), self.MPI.BYTE],
                       [dst.view(np.uint8), self.MPI.BYTE])

    def barrier(self) -> None:
        self._call("barrier", self.comm.Barrier)

    def close(self) -> None:
        """Safe to call more than once (a dimension's group may be the engine's world)."""
        comm, self.comm = self.comm, self.MPI.COMM_NULL
        if comm != self.MPI.COMM_WORLD and comm != self.MPI.COMM_NULL:
            try:
                comm.Free()
            except self.MPI.Exception:
                pass
