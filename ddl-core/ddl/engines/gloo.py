"""Cross-host engine on Gloo, through torch's ProcessGroupGloo.

Groups are made directly from ddl's job-wide rendezvous (``ddl.rendezvous``: on rank 0 at
MASTER_ADDR:DDL_PORT, serving only ranks that prove the job's secret), never through
``torch.distributed.init_process_group``: the user's own default process group (DDP on gloo
or nccl) stays theirs. ``GLOO_SOCKET_IFNAME`` (set by ``ddlrun --network-interface``) picks
the interface. Gloo's own data connections, which the members open to one another after
meeting in the store, are not authenticated (as in torch).

Every group is made after its members have checked in (``ddl/<name>/here/<i>``) within the
creation timeout, so a member that never comes is named in a DDLTimeoutError instead of
surfacing as Gloo's error about a store key.

A group offers point-to-point exchange of raw bytes (used by ddl's own ring and
halving-doubling algorithms, which reduce with ddl's kernel and so handle every dtype) and
Gloo's native collectives.
"""

from __future__ import annotations

import datetime
import time

import numpy as np

from .. import rendezvous as rendezvous_mod
from ..dtypes import DType
from ..errors import DDLConfigError, DDLError, DDLPeerError, DDLTimeoutError
from ..ops import ReduceOp
from ..rendezvous import Rendezvous
from .torch_pg import PGCaller

# The first rank whose process exits because of an uncaught exception says so here, before
# its groups close ("<rank>\n<reason>"): a peer whose call then fails names it and why
# (``GlooContext.announce_leaving``, ``GlooContext.who_left``).
LEAVING_KEY = "ddl/leaving"

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
    """The job-wide rendezvous every Gloo group of ddl is made from: ``rendezvous`` when the
    caller has one (it stays the caller's to close), else one joined now."""

    def __init__(self, rank: int, world: int, addr: str, port: int, timeout: float, *,
                 secret: bytes | None = None, rendezvous: Rendezvous | None = None):
        _torch()  # the install hint, before any connection is made
        from .torch_store import TorchStore

        self.rank = rank
        self.timeout = timeout
        self._owns = rendezvous is None
        if rendezvous is None:
            rendezvous = rendezvous_mod.connect(rank, world, addr, port, secret, timeout)
        self.rendezvous = rendezvous
        self.store = TorchStore(rendezvous.client, rendezvous)

    def group(self, name: str, members: tuple[int, ...], position: int) -> GlooGroup:
        """Made by the members only (they meet in the store under ``name``) within the
        context's timeout."""
        deadline = time.monotonic() + self.timeout
        self._check_in(name, members, position, self.timeout,
                       f"gloo group {name} (ranks {list(members)})",
                       "DDL_TIMEOUT sets the limit")
        return GlooGroup(self, name, members, position, deadline)

    def subgroup(self, name: str, members: tuple[int, ...], position: int,
                 timeout: float) -> GlooGroup:
        """``group`` within ``timeout`` seconds (``ddl.new_group``'s)."""
        deadline = time.monotonic() + timeout
        self._check_in(name, members, position, timeout, f"new_group({list(members)})",
                       "new_group's timeout, DDL_INIT_TIMEOUT by default")
        return GlooGroup(self, name, members, position, deadline)

    def _check_in(self, name: str, members: tuple[int, ...], position: int, timeout: float,
                  what: str, knob: str) -> None:
        client = self.rendezvous.client
        here = [f"ddl/{name}/here/{i}" for i in range(len(members))]
        client.set(here[position], b"1")
        try:
            client.wait(here, timeout)
        except DDLTimeoutError:
            missing = [members[i] for i, k in enumerate(here) if not client.check([k])]
            raise DDLTimeoutError(
                f"rank {self.rank}: {what}: rank(s) {missing} did not join within "
                f"{timeout:g}s ({knob})"
            ) from None

    def announce_leaving(self, why: str) -> None:
        """This process exits because of ``why`` (ddl.failures.leaving): tell the store
        before the groups close (the first rank to leave is kept)."""
        try:
            self.rendezvous.client.compare_set(LEAVING_KEY, b"", f"{self.rank}\n{why}".encode())
        except DDLError:
            pass  # the store is gone too: the peers find out from their connections

    def who_left(self) -> str:
        """"rank 3's process is exiting (ValueError: boom)" when a rank announced that it
        leaves; "" when none did or the store cannot say at once."""
        try:
            value = self.rendezvous.client.get(LEAVING_KEY, timeout=0)
        except DDLError:
            return ""
        rank, _, why = value.decode(errors="replace").partition("\n")
        return f"rank {rank}'s process is exiting ({why})"

    def close(self) -> None:
        """Leave the rendezvous if this context joined it."""
        if self._owns:
            self.rendezvous.close()


class GlooGroup:
    """An ``engines.base.PeerGroup`` over a torch Gloo process group."""

    name = "gloo"

    def __init__(self, ctx: GlooContext, name: str, members: tuple[int, ...], position: int,
                 deadline: float):
        """Made once every member has checked in; waits for them until ``deadline`` (a
        ``time.monotonic()`` value) at most."""
        torch, dist = _torch()
        self._ctx = ctx
        self._torch = torch
        self._dist = dist
        self.members = members
        self.size = len(members)
        self.rank = position
        self.global_rank = members[position]
        self.label = name
        self.timeout = ctx.timeout
        where = f"gloo group {name} (ranks {list(members)})"
        # Every member has checked in: what is left to wait for is a member that stopped
        # since, and the deadline keeps that wait within the creation timeout (torch's own
        # timeout here is also every collective's). The floor leaves the last member to
        # check in, just before the deadline, the round trips it needs.
        budget = max(deadline - time.monotonic(), 1.0)
        store = dist.PrefixStore(f"ddl/{name}/", ctx.store.with_deadline(budget))
        td = datetime.timedelta(seconds=max(ctx.timeout, 1.0))
        try:
            pg = dist.ProcessGroupGloo(store, position, self.size, td)
        except DDLTimeoutError as exc:
            raise DDLTimeoutError(
                f"rank {self.global_rank}: {where}: a member stopped after checking in, while "
                f"the group was made: {exc}"
            ) from None
        except RuntimeError as exc:
            if isinstance(exc, DDLError):
                raise
            first = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise DDLPeerError(f"rank {self.global_rank}: cannot make {where}: {first}") from None
        self._calls = PGCaller(pg, self.global_rank, where)
        self._ops = {
            ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVERAGE: dist.ReduceOp.SUM,
            ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
        }
        self._tag = 0

    # -------------------------------------------------------------- helpers
    def _run(self, what: str, *issues) -> None:
        """``PGCaller.run``; a lost peer that said why it left is named, with its reason."""
        try:
            self._calls.run(what, *issues)
        except DDLPeerError as exc:
            left = self._ctx.who_left()
            if left:
                exc.args = (f"{exc}; {left}",)
            raise

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
        self._run("sendrecv", *issues)

    # --------------------------------------------------------------- native
    def allreduce(self, buf: np.ndarray, dt: DType, op: ReduceOp) -> None:
        """In place; Average divides after the sum."""
        if buf.size == 0:
            return
        t = self._tensor(buf, dt)
        opts = self._dist.AllreduceOptions()
        opts.reduceOp = self._ops[op]
        self._run(f"allreduce({dt.name}[{buf.size}])", lambda pg: pg.allreduce([t], opts))
        if op is ReduceOp.AVERAGE:
            t.div_(self.size)  # on the tensor view: right for bfloat16 too

    def broadcast(self, buf: np.ndarray, dt: DType, root: int) -> None:
        if buf.size == 0:
            return
        opts = self._dist.BroadcastOptions()
        opts.rootRank = root
        t = self._tensor(buf.view(np.uint8))
        self._run(f"broadcast({dt.name}[{buf.size}])", lambda pg: pg.broadcast([t], opts))

    def allgather_bytes(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Equal-size allgather of raw bytes: dst = concat over ranks of src."""
        if dst.nbytes == 0:
            return
        out, inp = self._tensor(dst.view(np.uint8)), self._tensor(src.view(np.uint8))
        self._run("allgather", lambda pg: pg._allgather_base(out, inp))

    def barrier(self) -> None:
        one = self._torch.zeros(1, dtype=self._torch.uint8)
        self._run("barrier", lambda pg: pg.allreduce([one]))

    def close(self) -> None:
        self._calls.close()
