"""The engine of a job that spans hosts (or asks for a grid): the DDL multi-dimensional
allreduce over per-dimension engines (shared memory inside a host, Gloo across), plus a
job-wide Gloo group for the collectives that have no multi-dimensional form yet.

``DimsEngine`` is that pair (a multi-dimensional allreduce and one group of every member)
for any set of ranks: ``MultiHostEngine`` builds it for the job from the grid plan, and
``ddl.new_group`` for a group of ranks on several hosts."""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable

import numpy as np

from .. import config, cost, failures
from .. import grid as gridmod
from .. import timeline as _tl
from ..algorithms.dims import GroupDim, ShmDim
from ..algorithms.multidim import MultiDim
from ..config import CHUNK_MIN
from ..dtypes import BY_NAME, DType
from ..errors import DDLError, DDLMismatchError
from ..identity import job_secret
from ..ops import ReduceOp
from ..options import Options
from ..rendezvous import Rendezvous
from ..tensors import Pieces, copy_flat
from ..topology import World
from . import agreement, identity_round
from .base import PeerContext, PeerGroup
from .gloo import GlooContext
from .shm import ShmEngine
from .shm_meta import (
    ALLGATHER,
    ALLREDUCE,
    BARRIER,
    BROADCAST,
    REDUCE_SCATTER,
    Fold,
    Unfolded,
    shape_hash,
)

# A core call's key in the identity round (a Horovod descriptor's first word is a small kind,
# so the two never compare equal): the collective, then what every rank must agree on.
_CORE_KEY = 1 << 40


def round_covers(dims: list, size: int) -> tuple | None:
    """(local engine or None, line group) when the identity round covers these dimensions
    (one across hosts, after at most one inside them), else None."""
    if len(dims) == 1 and isinstance(dims[0], GroupDim) and dims[0].size == size:
        return None, dims[0].group
    if (len(dims) == 2 and isinstance(dims[0], ShmDim) and isinstance(dims[1], GroupDim)
            and dims[0].size * dims[1].size == size):
        return dims[0].engine, dims[1].group
    return None


class DimsEngine:
    """Collectives of ``size`` ranks: allreduce over ``multidim``, the rest over ``group``
    (a network group of every member, which this engine owns). An ``engines.base.Engine``
    with the ``IdentityFold`` capability (identities ride on ``identity_round``)."""

    heap = None  # ddl.malloc gives private memory here: peers are not all on this host

    def __init__(self, multidim: MultiDim, group: PeerGroup, size: int, rank: int, name: str,
                 host_line: PeerGroup | None = None):
        """``host_line``: the network group of this rank's counterparts on every host (its
        owner closes it), for a grid whose first dimension is the host's ranks and whose
        others all cross hosts (``grid.host_line``)."""
        self.name = name
        self.multidim = multidim
        self.world_group = group
        self.size = size
        self.rank = rank
        self._failed: BaseException | None = None
        # Call identities ride on each call's first message (engines/identity_round.py):
        # one row per host along this rank's line where the grid is the host's ranks, then
        # dimensions across hosts (the one across-host dimension's group, or ``host_line``
        # when there are several); on any other grid (two dimensions inside a host, or none
        # spanning it) every rank's row goes to every rank over the engine's own group,
        # dearer but as safe.
        self.armed: Fold | None = None
        self._core_folds: dict[tuple, Fold] = {}
        found = round_covers(multidim.dims, size)
        if found is None and host_line is not None:
            found = (multidim.dims[0].engine, host_line)
        found = found or (None, group)
        self._round = identity_round.IdentityRound(*found, size, rank)

    def _guard(self, fn: Callable, *args):
        """A peer lost across hosts leaves the groups unusable: fail every later call at
        once, naming the first error, as the shared-memory engine does."""
        if self._failed is not None:
            raise DDLError(f"rank {self.rank}: the multi-host engine failed earlier "
                           f"({self._failed}); the job cannot continue")
        try:
            return fn(*args)
        except (DDLMismatchError, Unfolded):
            raise  # every rank saw the same rows: still in step
        except BaseException as exc:
            self._failed = exc
            raise

    # ------------------------------------------------------------ call identities
    def fold_identity(self, fold: Fold) -> None:
        """Carry ``fold``'s descriptor in the next collective's identity round."""
        self.armed = fold

    def cancel_fold(self) -> Fold | None:
        fold, self.armed = self.armed, None
        return fold

    def exchange_identity(self, desc: np.ndarray) -> np.ndarray:
        """The MAX of every rank's ``desc``, in place: a round of this rank's own, which
        meets the others' folded ones."""
        return self._guard(self._round.alone, desc)

    def _settle(self) -> None:
        """Before a collective's data moves: the round of the identity armed for it."""
        fold, self.armed = self.armed, None
        self._guard(self._round.settle, fold)

    def refuse(self) -> None:
        """Take the place of a call this rank refused (``ShmEngine.refuse``), across hosts."""
        self._guard(self._round.refuse)

    # --------------------------------------------------------- core calls' keys
    def _core(self, words: tuple, what: Callable[[], str], fn: Callable | None = None,
              *args) -> None:
        """A core call (no Horovod identity) checked across hosts before its data moves: its
        key (``words``) in the identity round, alone (``fn`` None) or with a small
        allreduce's data (``fn`` the round's allreduce). Inside a host the shared-memory
        engine checks the ranks' records itself; across hosts nothing else would: two
        different calls would pair (a float32 and an int32 allreduce of one size give
        garbage; two sizes abort the process in Gloo)."""
        fold = self._core_folds.get(words)
        if fold is None:
            key = np.array((_CORE_KEY, *words), np.int64)
            fold = Fold(np.concatenate([key, -key]), _differs)
            if len(self._core_folds) > 256:
                self._core_folds.clear()
            self._core_folds[words] = fold
        try:
            if fn is None:
                self._guard(self._round.settle, fold)
            else:
                self._guard(fn, fold, *args)
        except Unfolded:
            raise DDLMismatchError(
                f"rank {self.rank}: ranks on different hosts called different collectives "
                f"(this rank: {what()}): every rank must issue the same collectives in the "
                "same order, with the same op, dtype and shape") from None

    def describe(self) -> str:
        return self.multidim.describe()

    def allreduce(self, src: np.ndarray | Pieces, dst: np.ndarray | Pieces, dt: DType,
                  op: ReduceOp, shape) -> None:
        # A small allreduce rides on the round, unless -dump_iter counts (a job-wide option):
        # then it runs through the dimensions, whose times it prints. Whether the timeline
        # records must not decide it: a rank may record alone, and every rank must take the
        # same path (the round shows on the timeline as a phase of its own).
        small = src.nbytes <= identity_round.FOLD_BYTES and not self.multidim.dump_iter
        if self.armed is not None:
            if small:
                fold, self.armed = self.armed, None
                self._guard(self._ride, fold, src, dst, dt, op)
                return
            self._settle()
        else:
            what = lambda: f"allreduce({dt.name}[{src.size}], {op.name})"  # noqa: E731
            words = (ALLREDUCE, int(op), dt.code, src.size, shape_hash(shape))
            if small:
                self._core(words, what, self._ride, src, dst, dt, op)
                return
            self._core(words, what)
        if isinstance(dst, Pieces):  # in place on pieces: the pipeline needs one buffer
            work = np.empty(dst.size, dt.storage)
            copy_flat(src, work)
            self._guard(self.multidim.allreduce, work, dt, op)
            dst.copy_from(0, dst.size, work)
            return
        copy_flat(src, dst)  # the pipeline runs in place
        self._guard(self.multidim.allreduce, dst, dt, op)

    def _ride(self, fold: Fold, src, dst, dt: DType, op: ReduceOp) -> None:
        """A small allreduce on the round (``IdentityRound.allreduce``), timed as a phase."""
        t0 = time.perf_counter()
        self._round.allreduce(fold, src, dst, dt, op)
        if _tl.recorder is not None:
            _tl.phase("identity round", "phase", t0, time.perf_counter(),
                      {"bytes": int(src.nbytes)})

    def reduce_scatter(self, src, dst, dt: DType, op: ReduceOp, shape, counts) -> None:
        if self.armed is not None:
            self._settle()
        else:
            self._core((REDUCE_SCATTER, int(op), dt.code, src.size, shape_hash(shape)),
                       lambda: f"reduce_scatter({dt.name}[{src.size}], {op.name})")
        work = src.copy()
        self._guard(self.multidim.allreduce, work, dt, op)
        o = sum(counts[: self.rank])
        np.copyto(dst, work[o : o + counts[self.rank]])

    def allgather(self, src, dt: DType, row_shape, alloc: Callable[[list[int]], np.ndarray]):
        if self.armed is not None:
            self._settle()
        else:  # (first dimensions may differ)
            self._core((ALLGATHER, dt.code, shape_hash(tuple(row_shape))),
                       lambda: f"allgather({dt.name} rows of {tuple(row_shape)})")
        return self._guard(self._allgather, src, dt, alloc)

    def _allgather(self, src, dt: DType, alloc):
        g = self.world_group
        sizes = np.zeros(self.size, np.int64)
        g.allgather_bytes(np.array([src.size], np.int64), sizes)
        counts = sizes.tolist()
        dst = alloc(counts)
        m = max(counts) if counts else 0
        if m == 0:
            return dst
        padded = np.zeros(m, dt.storage)
        padded[: src.size] = src
        out = np.empty(m * self.size, dt.storage)
        g.allgather_bytes(padded, out)
        o = 0
        for i, c in enumerate(counts):
            dst[o : o + c] = out[i * m : i * m + c]
            o += c
        return dst

    def broadcast(self, buf, dt: DType, root: int, shape) -> None:
        if self.armed is not None:
            self._settle()
        else:
            self._core((BROADCAST, dt.code, buf.size, shape_hash(shape), root),
                       lambda: f"broadcast({dt.name}[{buf.size}], root {root})")
        self._guard(self.world_group.broadcast, buf, dt, root)

    def barrier(self) -> None:
        if self.armed is not None:
            self._settle()
        else:
            self._core((BARRIER,), lambda: "barrier")
        self._guard(self.world_group.barrier)

    def close(self) -> None:
        try:
            self.multidim.close()
        finally:
            self.world_group.close()  # a second close of a group a dimension uses is harmless


def gloo_wanted(grid: gridmod.Grid, transport: str) -> set[int]:
    """The dimensions across hosts that get Gloo's group beside MPI's (DDL_GLOO_BESIDE_MPI):
    'auto' those in mode 'p' (timed at start) and those in mode 'b' whose links
    DDL_COST_PROFILE measured on both engines (``second_link``); '1' every 'b' and 'p' one
    (calibrate, so that it can measure Gloo); '0' none. Measured across two hosts under
    mpirun: Open MPI's TCP allreduce is 10x faster than Gloo's at 4 KiB and 1.5x slower at
    16 MiB (docs/performance.md)."""
    setting = config.get("DDL_GLOO_BESIDE_MPI")
    if transport != "mpi" or setting == "0":
        return set()
    out = set()
    for d in grid.dims:
        if d.intra_host or d.size < 2 or d.mode not in "bp":
            continue
        if setting == "1" or d.mode == "p" or second_link(d.index, transport) is not None:
            out.add(d.index)
    return out


def gloo_reachable(rendezvous: Rendezvous | None) -> bool:
    """Whether this rank can make Gloo groups: it reaches rank 0's rendezvous (init joined
    it, or MASTER_ADDR names it: the default 127.0.0.1 is rank 0's only on one host) and
    torch imports. Imported now, before rank 0 opens the rendezvous: loading torch holds the
    interpreter for seconds, and the rendezvous's thread must greet the others."""
    if rendezvous is None and "MASTER_ADDR" not in os.environ:
        return False
    try:
        importlib.import_module("torch")
    except Exception:  # noqa: BLE001 - a broken torch (CUDA libraries) is no torch here
        return False
    return True


def agree_gloo_beside(grid: gridmod.Grid, rendezvous: Rendezvous | None) -> bool:
    """Whether this MPI job makes Gloo groups beside MPI's: every rank of COMM_WORLD says
    whether it wants them and can (the MIN over all: one that cannot keeps all on MPI
    alone, where one rank joining a rendezvous that the others skip would wait out the
    init timeout). Every rank of an MPI job calls it once, before the engine is made."""
    from .mpi import all_ranks

    return all_ranks(bool(gloo_wanted(grid, "mpi")) and gloo_reachable(rendezvous))


def second_link(index: int, transport: str) -> cost.Link | None:
    """Gloo's link on dimension ``index`` from DDL_COST_PROFILE, when it measured both
    Gloo and the job's own engine there (mode b compares two measurements, never one
    against the defaults); else None."""
    profile = cost.env_profile()
    if profile is None or profile.exact(index, transport) is None:
        return None
    return profile.exact(index, "gloo")


def planning_settings(grid: gridmod.Grid, opts: Options, chunk_bytes: int, transport: str,
                      beside: bool = False) -> list[agreement.Setting]:
    """What this rank plans a multi-host job's collectives with, for ``agreement.agree``:
    the grid and its modes, whether ``-dump_iter`` sends small allreduces through the
    dimensions, the pipeline's chunk, the links mode ``b`` and sub-groups price
    algorithms with (``cost.link_for``: the defaults, or DDL_COST_PROFILE's), and whether
    Gloo runs beside MPI (``beside``, with its measured links)."""
    across = [d.index for d in grid.dims if not d.intra_host and d.size > 1]
    links = [cost.link_for(i, transport) for i in across] + [cost.link_for(None, transport)]
    if beside:
        links += [second_link(i, transport) for i in across]
    profile = config.get("DDL_COST_PROFILE") or "unset (the defaults)"
    return [
        agreement.digest("-mode (the grid and its modes, DDL_OPTIONS, laid over each "
                         "host's LOCAL_WORLD_SIZE ranks)",
                         [(d.size, d.intra_host, d.mode) for d in grid.dims], grid.describe()),
        agreement.number("-dump_iter (DDL_OPTIONS)", opts.dump_iter),
        agreement.number("DDL_CHUNK_BYTES", max(CHUNK_MIN, chunk_bytes)),
        agreement.digest("DDL_COST_PROFILE links", links, profile),
        agreement.digest("DDL_GLOO_BESIDE_MPI", sorted(gloo_wanted(grid, transport)),
                         config.get("DDL_GLOO_BESIDE_MPI")),
    ]


def _differs(result: np.ndarray) -> bool:
    """A core key's MAX: its words, then the negated ones (minus the smallest): whether
    some rank's key differs from another's."""
    n = result.size // 2
    return bool((result[:n] + result[n:]).any())


class MultiHostEngine(DimsEngine):
    def __init__(self, world: World, opts: Options, *, transport: str, addr: str, port: int,
                 timeout: float, chunk_bytes: int, shm_kwargs: dict,
                 secret: bytes | None = None, rendezvous: Rendezvous | None = None,
                 beside: bool = False):
        """``rendezvous``: the job's, when init joined it already (it stays init's to
        close); else one is joined at ``addr:port`` with ``secret`` (default: the job's,
        from DDL_JOB_SECRET / DDL_JOB_SECRET_FILE). ``beside``: the ranks agreed to make
        Gloo groups beside MPI's (``agree_gloo_beside``)."""
        self.world = world
        self.grid = gridmod.plan(world.rank, world.size, world.local_size, opts)
        self.ctx: PeerContext  # what ddl.new_group makes this job's network groups from
        if rendezvous is None and secret is None:
            secret = job_secret()
        if transport == "mpi":
            from .mpi import MPIContext

            self.ctx = MPIContext()
        else:
            self.ctx = GlooContext(world.rank, world.size, addr, port, timeout, secret=secret,
                                   rendezvous=rendezvous)
        if shm_kwargs.get("wait_policy", "auto") == "auto":
            # The dimensions across hosts run beside this one in their own threads (network
            # I/O and reductions): a spinning waiter would take the cores they need. Measured
            # at 2 hosts x 2 ranks, 16 MiB: 1.45x flat Gloo with futex waits, 1.37x spinning.
            shm_kwargs = dict(shm_kwargs, wait_policy="futex")
        dims: list = []
        self._host_line = None
        # the group of every member first: the ranks compare what they plan with over it
        # before any dimension's group is made from a plan they might not share
        world_group = self.ctx.group("world", tuple(range(world.size)), world.rank)
        self.second_ctx: GlooContext | None = None
        try:
            agreement.agree(world_group, range(world.size),
                            planning_settings(self.grid, opts, chunk_bytes, transport, beside),
                            world.rank)
            wanted = gloo_wanted(self.grid, transport) if beside else set()
            if wanted:  # every rank agreed to (agree_gloo_beside): all join the rendezvous
                self.second_ctx = GlooContext(world.rank, world.size, addr, port, timeout,
                                              secret=secret, rendezvous=rendezvous)
            for d in self.grid.dims:
                if d.size == 1:
                    continue
                if d.intra_host:
                    eng = ShmEngine(job_id=world.job_id, host_index=world.host_index,
                                    local_rank=d.position, local_size=d.size,
                                    global_rank=world.rank, scope=f"d{d.index}l{d.line_id}",
                                    timeout=timeout, **shm_kwargs)
                    dims.append(ShmDim(eng, d.index))
                else:
                    group = self.ctx.group(f"d{d.index}l{d.line_id}", d.members, d.position)
                    dim = GroupDim(group, d.index, d.mode, cost.link_for(d.index, transport))
                    dims.append(dim)
                    if self.second_ctx is not None and d.index in wanted:
                        dim.second = self.second_ctx.group(f"g{d.index}l{d.line_id}",
                                                           d.members, d.position)
                        dim.second_link = second_link(d.index, transport)
            line = gridmod.host_line(self.grid, world.rank, world.local_size)
            if line is not None and round_covers(dims, world.size) is None:
                members, position = line
                self._host_line = self.ctx.group(f"idline{members[0]}", members, position)
            for dim in dims:
                if isinstance(dim, GroupDim) and dim.mode == "p":
                    dim.explore(BY_NAME["float32"])
        except BaseException:
            for dim in dims:
                dim.close()
            if self._host_line is not None:
                self._host_line.close()
            world_group.close()
            if self.second_ctx is not None:
                self.second_ctx.close()
            raise
        super().__init__(MultiDim(dims, world.size, world.rank, chunk_bytes=chunk_bytes,
                                  timeout=timeout, dump_iter=opts.dump_iter),
                         world_group, world.size, world.rank, f"ddl/{transport}",
                         host_line=self._host_line)

    def close(self) -> None:
        why = failures.leaving()
        for ctx in (self.ctx, self.second_ctx):
            if why and isinstance(ctx, GlooContext):  # before the groups close
                ctx.announce_leaving(why)
        try:
            try:
                super().close()
            finally:
                if self._host_line is not None:
                    self._host_line.close()
        finally:
            try:
                self.ctx.close()
            finally:
                if self.second_ctx is not None:
                    self.second_ctx.close()  # the rendezvous, when the context joined its own
