"""Cross-host engine on Gloo, through torch's ProcessGroupGloo.

Groups are made directly from one job-wide TCPStore (on rank 0 at MASTER_ADDR:DDL_PORT),
never through ``torch.distributed.init_process_group``: the user's own default process group
(DDP on gloo or nccl) stays theirs. ``GLOO_SOCKET_IFNAME`` (set by ``ddlrun
--network-interface``) picks the interface.

A group offers point-to-point exchange of raw bytes (used by ddl's own ring and
halving-doubling algorithms, which reduce with ddl's kernel and so handle every dtype) and
Gloo's native collectives.
"""

from __future__ import annotations

import datetime

import numpy as np

from ..dtypes import DType
from ..errors import DDLConfigError, DDLError, DDLTimeoutError
from ..ops import ReduceOp
from .torch_pg import PGCaller

_NATIVE_DTYPES = {"uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64",
                  "bool"}


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency of the gloo engine
        raise DDLConfigError(
            "the gloo engine needs PyTorch: pip install 'powerddl[torch]'"
        ) from None
    return torch, dist


class GlooContext:
    """The job-wide rendezvous every Gloo group of ddl is made from."""

    def __init__(self, rank: int, world: int, addr: str, port: int, timeout: float):
        torch, dist = _torch()
        self.rank = rank
        self.timeout = timeout
        td = datetime.timedelta(seconds=max(timeout, 1.0))
        try:
            self.store = dist.TCPStore(addr, port, world, rank == 0, td)
        except (RuntimeError, OSError) as exc:
            hint = "is the port in use? set DDL_PORT" if rank == 0 else (
                "is rank 0 up and the address reachable? ddlrun --network-interface picks it")
            raise DDLError(
                f"rank {rank}: cannot open the ddl rendezvous at {addr}:{port} ({exc}); {hint}"
            ) from None

    def group(self, name: str, members: tuple[int, ...], position: int) -> GlooGroup:
        """Made by the members only (they meet in the store under ``name``)."""
        return GlooGroup(self, name, members, position)

    def subgroup(self, name: str, members: tuple[int, ...], position: int,
                 timeout: float) -> GlooGroup:
        """``group``, after the members have all checked in within ``timeout`` seconds
        (``ddl.new_group``: a member may never come, and the error should name it)."""
        _, dist = _torch()
        here = [f"ddl/{name}/here/{i}" for i in range(len(members))]
        self.store.set(here[position], "1")
        try:
            self.store.wait(here, datetime.timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError):
            missing = [members[i] for i, k in enumerate(here) if not self.store.check([k])]
            raise DDLTimeoutError(
                f"rank {self.rank}: new_group({list(members)}): rank(s) {missing} did not "
                f"join within {timeout:g}s (new_group's timeout, DDL_INIT_TIMEOUT by default)"
            ) from None
        return GlooGroup(self, name, members, position)


class GlooGroup:
    name = "gloo"

    def __init__(self, ctx: GlooContext, name: str, members: tuple[int, ...], position: int):
        torch, dist = _torch()
        self._torch = torch
        self._dist = dist
        self.members = members
        self.size = len(members)
        self.rank = position
        self.global_rank = members[position]
        self.label = name
        self.timeout = ctx.timeout
        store = dist.PrefixStore(f"ddl/{name}/", ctx.store)
        td = datetime.timedelta(seconds=max(ctx.timeout, 1.0))
        self._calls = PGCaller(dist.ProcessGroupGloo(store, position, self.size, td),
                               self.global_rank,
                               f"gloo group {name} (ranks {list(members)})")
        self._ops = {
            ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVERAGE: dist.ReduceOp.SUM,
            ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
        }
        self._tag = 0

    # -------------------------------------------------------------- helpers
    def _tensor(self, arr: np.ndarray, dt: DType | None = None):
        t = self._torch.from_numpy(arr)
        if dt is not None and dt.name == "bfloat16":
            t = t.view(self._torch.bfloat16)
        return t

    def native_ok(self, dt: DType) -> bool:
        return dt.name in _NATIVE_DTYPES

    # ------------------------------------------------------------------ p2p
    def sendrecv(self, send: np.ndarray, to: int, recv: np.ndarray, frm: int) -> None:
        """Send ``send`` to group rank ``to`` while receiving ``recv`` from ``frm`` (bytes)."""
        self._tag = tag = (self._tag + 1) & 0x3FFFFFFF
        issues = []
        if send.nbytes:
            s = self._tensor(send.view(np.uint8))
            issues.append(lambda pg: pg.send([s], to, tag))
        if recv.nbytes:
            r = self._tensor(recv.view(np.uint8))
            issues.append(lambda pg: pg.recv([r], frm, tag))
        self._calls.run("sendrecv", *issues)

    # --------------------------------------------------------------- native
    def allreduce(self, buf: np.ndarray, dt: DType, op: ReduceOp) -> None:
        """In place; Average divides after the sum."""
        if buf.size == 0:
            return
        t = self._tensor(buf, dt)
        opts = self._dist.AllreduceOptions()
        opts.reduceOp = self._ops[op]
        self._calls.run(f"allreduce({dt.name}[{buf.size}])", lambda pg: pg.allreduce([t], opts))
        if op is ReduceOp.AVERAGE:
            t.div_(self.size)  # on the tensor view: right for bfloat16 too

    def broadcast(self, buf: np.ndarray, dt: DType, root: int) -> None:
        if buf.size == 0:
            return
        opts = self._dist.BroadcastOptions()
        opts.rootRank = root
        t = self._tensor(buf.view(np.uint8))
        self._calls.run(f"broadcast({dt.name}[{buf.size}])", lambda pg: pg.broadcast([t], opts))

    def allgather_bytes(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Equal-size allgather of raw bytes: dst = concat over ranks of src."""
        if dst.nbytes == 0:
            return
        out, inp = self._tensor(dst.view(np.uint8)), self._tensor(src.view(np.uint8))
        self._calls.run("allgather", lambda pg: pg._allgather_base(out, inp))

    def barrier(self) -> None:
        one = self._torch.zeros(1, dtype=self._torch.uint8)
        self._calls.run("barrier", lambda pg: pg.allreduce([one]))

    def close(self) -> None:
        self._calls.close()
