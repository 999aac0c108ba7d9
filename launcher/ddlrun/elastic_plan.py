"""The next world of an elastic job (pure: no processes, no I/O).

Given the hosts available now (discovered, minus the blacklist) and the workers still
alive, ``plan_world`` says who is in the next world with which rank, and which workers
to start. The rules are Horovod's: the ranks' order stays as stable as it can, so rank 0,
the rank whose state every other rank receives (``State.sync``), stays a survivor.

- Hosts: those with surviving workers first, in the order they had in ``previous`` (the
  world the survivors come from; hosts it lacks after, in ``host_order``), then the
  others in ``host_order`` (the order hosts were first seen). So a survivor host keeps its
  place and a host that comes back after a cooldown goes after them.
- On a host: its survivors keep their slots (a worker's ``slot`` never changes); free
  slot numbers ``0..slots-1`` go to new workers, lowest first. Survivors take the host's
  first local ranks, in their order in ``previous`` (then slot order), new workers the
  next ones in slot order: with ``previous`` given, the surviving ranks keep their
  relative order, so rank 0 stays rank 0 while it lives and its host is available. A
  survivor whose slot the host no longer has (fewer slots discovered) is not in the world.
- ``max_np``: places beyond it are dropped from the last hosts first, new workers before
  survivors. Fewer than ``min_np`` places: no world (None).
- A host's ranks are contiguous; ``cross_rank`` / ``host_index`` is the host's index in
  the world, ``cross_size`` the number of hosts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Worker:
    """One worker process's identity: its host and the slot it was started in."""

    host: str
    slot: int

    @property
    def name(self) -> str:
        """``host:slot``, as ddlrun's output names a worker."""
        return f"{self.host}:{self.slot}"


@dataclass(frozen=True)
class Place:
    """A worker's place in one world."""

    worker: Worker
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host_index: int


@dataclass(frozen=True)
class World:
    """The ranks of one world, in rank order; ``hosts`` in rank order too."""

    places: tuple[Place, ...]
    hosts: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.places)

    def workers(self) -> tuple[Worker, ...]:
        """The world's workers in rank order."""
        return tuple(place.worker for place in self.places)


@dataclass
class _HostCandidates:
    host: str
    survivors: list[Worker]  # by rank in the previous world, then slot
    new: list[Worker]  # free slots, lowest first


def plan_world(hosts: dict[str, int], alive: list[Worker], min_np: int, max_np: int,
               host_order: list[str], previous: World | None = None,
               excluded: frozenset[str] = frozenset()) -> tuple[World, list[Worker]] | None:
    """The next world from ``hosts`` (available now: host -> slots) and the ``alive``
    workers, and the new workers to start for it; None when fewer than ``min_np`` ranks
    would remain. ``previous`` (the world the survivors come from) keeps their order;
    ``excluded``: worker names (``host:slot``) no new worker may take (a slot whose worker
    failed, in its cooldown); see the module docstring for the rules."""
    if not 1 <= min_np <= max_np:
        raise ValueError(f"need 1 <= min_np <= max_np, got min_np={min_np}, max_np={max_np}")
    before = _previous_ranks(previous)
    candidates = [_candidates(host, hosts[host], alive, before, excluded)
                  for host in _ordered(hosts, alive, host_order, previous)]
    _cap(candidates, max_np)
    total = sum(len(c.survivors) + len(c.new) for c in candidates)
    if total < min_np:
        return None
    members = [c for c in candidates if c.survivors or c.new]
    places: list[Place] = []
    for index, cand in enumerate(members):
        local = cand.survivors + cand.new
        for local_rank, worker in enumerate(local):
            places.append(Place(worker=worker, rank=len(places), local_rank=local_rank,
                                local_size=len(local), cross_rank=index,
                                cross_size=len(members), host_index=index))
    world = World(places=tuple(places), hosts=tuple(c.host for c in members))
    return world, [worker for c in members for worker in c.new]


def describe_world(world: World) -> str:
    """One line, e.g. ``4 ranks on 2 hosts (a:2, b:2)``."""
    counts = Counter(place.worker.host for place in world.places)
    per_host = ", ".join(f"{host}:{counts[host]}" for host in world.hosts)
    ranks = "rank" if world.size == 1 else "ranks"
    on = "host" if len(world.hosts) == 1 else "hosts"
    return f"{world.size} {ranks} on {len(world.hosts)} {on} ({per_host})"


def _previous_ranks(previous: World | None) -> dict[Worker, int]:
    return {} if previous is None else {p.worker: p.rank for p in previous.places}


def _ordered(hosts: dict[str, int], alive: list[Worker], host_order: list[str],
             previous: World | None) -> list[str]:
    """Available hosts: survivor hosts (in ``previous``'s order, then ``host_order``'s),
    then the others in ``host_order`` (hosts it does not name after, in ``hosts``' order)."""
    known = list(dict.fromkeys([*host_order, *hosts]))
    available = [host for host in known if host in hosts]
    with_survivors = {w.host for w in alive if w.host in hosts and 0 <= w.slot < hosts[w.host]}
    was = {host: index for index, host in enumerate(previous.hosts if previous else ())}
    first = sorted((h for h in available if h in with_survivors),
                   key=lambda host: was.get(host, len(was)))  # stable: host_order next
    return first + [h for h in available if h not in with_survivors]


def _candidates(host: str, slots: int, alive: list[Worker],
                before: dict[Worker, int], excluded: frozenset[str]) -> _HostCandidates:
    """The host's survivors (by their rank before, then slot) and its free slots (those
    not ``excluded``)."""
    taken = {w.slot for w in alive if w.host == host and 0 <= w.slot < slots}
    survivors = sorted((Worker(host, slot) for slot in taken),
                       key=lambda worker: (before.get(worker, len(before)), worker.slot))
    free = [Worker(host, slot) for slot in range(slots)
            if slot not in taken and f"{host}:{slot}" not in excluded]
    return _HostCandidates(host, survivors, free)


def _cap(candidates: list[_HostCandidates], max_np: int) -> None:
    """Drop places beyond ``max_np``: new workers from the last hosts first, then
    survivors from the last hosts first (each host's highest local ranks first)."""
    excess = sum(len(c.survivors) + len(c.new) for c in candidates) - max_np
    for cand in reversed(candidates):
        excess = _drop_last(cand.new, excess)
    for cand in reversed(candidates):
        excess = _drop_last(cand.survivors, excess)


def _drop_last(workers: list[Worker], excess: int) -> int:
    """Remove up to ``excess`` workers from the end of ``workers``; the excess left."""
    drop = min(max(excess, 0), len(workers))
    del workers[len(workers) - drop:]
    return excess - drop
