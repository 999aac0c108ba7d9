"""Sub-communicators: collectives among some of the job's ranks (``ddl.new_group``).

A group is made by its members alone, as ``torch.distributed.new_group`` makes its backend
only on the members. The members agree on the group's name without talking: it is the
ordered member list plus how many groups of exactly those members this process made before
(members must create their groups in the same order, as torch and MPI require).

Its engine follows the members: shared memory when they are all on this host (the common
case: a tensor- or pipeline-parallel group inside a server), otherwise one network group of
the job's transport with DDL's algorithms over it (ring, halving-doubling or native, by the
cost model). Each group has its own queue (and worker thread): its collectives run in the
order the rank issues them, independently of other groups', as torch's process groups do.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence

import numpy as np

from . import cost
from .algorithms.dims import GroupDim
from .algorithms.multidim import MultiDim
from .engines.base import Engine, PeerGroup
from .engines.local import LocalEngine
from .engines.multihost import DimsEngine, MultiHostEngine
from .engines.shm import ShmEngine
from .errors import DDLConfigError
from .runtime import Runtime
from .topology import World


class Group:
    """The ranks ``ranks`` (global ranks; this process is ``ranks[rank]``)."""

    def __init__(self, ranks: tuple[int, ...], rank: int, engine: Engine, runtime: Runtime,
                 owned: bool):
        self.ranks = ranks
        self.rank = rank
        self.size = len(ranks)
        self.engine = engine
        self.runtime = runtime
        self._owned = owned  # False for a group of every rank: it is the job's engine/queue
        self.closed = False

    def __repr__(self) -> str:
        return f"<ddl.Group ranks={list(self.ranks)} rank={self.rank} engine={self.engine.name}>"

    def close(self) -> None:
        """Finish the group's queued work, then release its engine."""
        if not self.closed:
            self.closed = True
            if self._owned:
                try:
                    self.runtime.close()
                finally:
                    self.engine.close()


def check_ranks(ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    try:
        out = tuple(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise DDLConfigError(f"new_group: ranks must be integers, got {ranks!r}") from None
    if not out:
        raise DDLConfigError("new_group: a group needs at least one rank")
    if len(set(out)) != len(out):
        raise DDLConfigError(f"new_group: ranks {list(out)} repeat a rank")
    bad = [r for r in out if not 0 <= r < world_size]
    if bad:
        raise DDLConfigError(f"new_group: ranks {bad} are outside 0..{world_size - 1}")
    return out


class GroupMaker:
    """Makes this process's groups; remembers how many of each member list it made."""

    def __init__(self, world: World, engine: Engine, runtime: Runtime, *, timeout: float,
                 chunk_bytes: int, shm_kwargs: dict):
        self._world = world
        self._engine = engine
        self._runtime = runtime
        self._timeout = timeout
        self._chunk_bytes = chunk_bytes
        self._shm_kwargs = shm_kwargs
        self._made: Counter[tuple[int, ...]] = Counter()

    def make(self, ranks: tuple[int, ...], init_timeout: float) -> Group:
        """This process's part of a new group (it must be a member); waits up to
        ``init_timeout`` seconds for the other members."""
        w = self._world
        pos = ranks.index(w.rank)
        if ranks == tuple(range(w.size)):
            return Group(ranks, w.rank, self._engine, self._runtime, owned=False)
        k = self._made[ranks]
        self._made[ranks] += 1
        if len(ranks) == 1:
            return self._group(ranks, 0, LocalEngine())
        # segment-name safe, and the same on every member
        scope = f"g{zlib.crc32(repr(ranks).encode()):08x}n{k}"
        if w.local_size == w.size:  # every rank of the job is on this host
            return self._group(ranks, pos, self._shm(scope, pos, len(ranks), init_timeout))
        if not isinstance(self._engine, MultiHostEngine):  # pragma: no cover - it always is
            raise DDLConfigError("new_group: this job's engine cannot make sub-groups")
        net = self._engine.ctx.subgroup(scope, ranks, pos, init_timeout)
        try:
            hosts = np.zeros(len(ranks), np.int64)
            net.allgather_bytes(np.array([w.host_index], np.int64), hosts)
            if len(set(hosts.tolist())) == 1:  # all on this host after all
                engine = self._shm(scope, pos, len(ranks), init_timeout)
                net.close()
                return self._group(ranks, pos, engine)
            return self._group(ranks, pos, self._network(net, pos, len(ranks)))
        except BaseException:
            net.close()
            raise

    def _group(self, ranks: tuple[int, ...], pos: int, engine: Engine) -> Group:
        # the flight recorder's name of its queue: the same on every member (the k-th
        # group of these ranks), another for each group of the same ranks
        k = self._made[ranks] - 1
        name = f"group {list(ranks)}" + (f" #{k + 1}" if k else "")
        return Group(ranks, pos, engine, Runtime(name), owned=True)

    def _shm(self, scope: str, pos: int, n: int, init_timeout: float) -> ShmEngine:
        kwargs = dict(self._shm_kwargs, init_timeout=init_timeout)
        return ShmEngine(job_id=self._world.job_id, host_index=self._world.host_index,
                         local_rank=pos, local_size=n, global_rank=self._world.rank,
                         timeout=self._timeout, scope=scope, **kwargs)

    def _network(self, net: PeerGroup, pos: int, n: int) -> DimsEngine:
        # mode b plans the group's one dimension on the measured link (DDL_COST_PROFILE)
        dim = GroupDim(net, 0, "b", cost.link_for(None, net.name))
        multidim = MultiDim([dim], n, pos, chunk_bytes=self._chunk_bytes,
                            timeout=self._timeout)
        return DimsEngine(multidim, net, n, pos, f"ddl/{net.name}")
