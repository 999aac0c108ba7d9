"""Placement: which host each rank runs on, and as which local rank. Pure.

``host_gpus`` decides each host's GPUs (the user's CUDA_VISIBLE_DEVICES, the GPUs probed,
--include/--exclude lists, --bind-gpus), ``slots_per_host`` how many ranks each host
takes, ``assign`` fills the hosts in turn (or follows a user's rankfile, ``parse_rankfile``)
and ``layout_of`` turns that into the ``Layout`` the env is built from (with one ddlrun per
node, this node's share of the whole job).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import UsageError
from .hosts import HostSpec, is_local, validate_hostname
from .plan_types import HostFacts, HostGpus, Request


def split_ids(text: str) -> tuple[str, ...]:
    """``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) as a tuple of ids."""
    return tuple(i.strip() for i in text.split(",") if i.strip())


def _selection(entries, host: HostSpec) -> tuple[bool, tuple[str, ...] | None]:
    """(host named, its GPU ids or None for the whole host) in --include/--exclude."""
    for name, ids in entries:
        if name == host.name or (is_local(name) and is_local(host.name)):
            return True, ids
    return False, None


def host_gpus(req: Request, host: HostSpec, facts: HostFacts | None,
              user_visible: str | None) -> HostGpus:
    """The GPUs ranks on ``host`` use. The set: the user's CUDA_VISIBLE_DEVICES on a host
    with GPUs, else the GPUs detected (0..n-1), else (for --include/--exclude only) the
    host's slots 0..N-1. --include host:ids replaces it, --exclude host:ids removes from it;
    either makes CUDA_VISIBLE_DEVICES that list. --bind-gpus gives each rank one."""
    gpus = facts.gpus if facts else 0
    if gpus and user_visible is not None:
        ids = split_ids(user_visible)
    else:
        ids = tuple(str(i) for i in range(gpus))
    mode = "leave"
    named, chosen = _selection(req.include, host)
    if named and chosen is not None:
        ids, mode = chosen, "set"
    named, dropped = _selection(req.exclude, host)
    if named and dropped is not None:
        if not ids and host.slots:
            ids = tuple(str(i) for i in range(host.slots))
        if not ids:
            raise UsageError(f"--exclude {host.name}:{','.join(dropped)}: the GPUs of "
                             f"{host.name} are unknown (not probed, no slots): give "
                             f"{host.name}:N or use --include")
        ids, mode = tuple(i for i in ids if i not in dropped), "set"
        if not ids:
            raise UsageError(f"--exclude leaves no GPUs on {host.name}")
    selected = mode == "set"
    if req.bind_gpus and ids:
        mode = "bind"
    return HostGpus(ids, mode, selected)


def slots_per_host(req: Request, facts: Mapping[str, HostFacts],
                   gpus: Sequence[HostGpus] | None = None) -> list[int]:
    """Ranks each host can take: --accelerators, else its --include/--exclude GPU list,
    else the host's slots, else its GPUs (CUDA_VISIBLE_DEVICES counts), else -n for a
    single host, else 1."""
    if gpus is None:
        gpus = [host_gpus(req, h, facts.get(h.name), None) for h in req.hosts]
    out = []
    for h, g in zip(req.hosts, gpus, strict=True):
        if req.accelerators is not None:
            out.append(req.accelerators)
        elif g.selected:
            out.append(len(g.ids))
        elif h.slots is not None:
            out.append(h.slots)
        elif g.ids:  # the GPUs detected, or those of the user's CUDA_VISIBLE_DEVICES
            out.append(len(g.ids))
        elif len(req.hosts) == 1 and req.nproc:
            out.append(req.nproc)
        else:
            out.append(1)
    return out


def unknown_slots(req: Request, facts: Mapping[str, HostFacts]) -> tuple[str, ...]:
    """Hosts whose rank count is a guess: no slots, no --accelerators, not probed."""
    if req.accelerators is not None or req.rankfile or (len(req.hosts) == 1 and req.nproc):
        return ()
    return tuple(h.name for h in req.hosts
                 if h.slots is None and h.name not in facts
                 and _selection(req.include, h)[1] is None)


def assign(req: Request, facts: Mapping[str, HostFacts],
           gpus: Sequence[HostGpus] | None = None) -> list[tuple[int, int]]:
    """(host index, local rank) for every rank, in rank order. Fills host by host."""
    if not req.hosts:
        raise UsageError("no hosts: give -n N for local ranks, or -H / --hostfile")
    if req.rankfile:
        return _assign_rankfile(req)
    slots = slots_per_host(req, facts, gpus)
    total = sum(slots)
    n = req.nproc if req.nproc is not None else total
    if n < 1:
        raise UsageError(f"-n must be at least 1, got {n}")
    if n > total:
        listing = ", ".join(f"{h.name}:{s}" for h, s in zip(req.hosts, slots, strict=True))
        raise UsageError(
            f"asked for {n} ranks but the hosts provide only {total} slots ({listing}): "
            "add hosts, raise slots (host:N / slots=N / --accelerators) or lower -n"
        )
    out: list[tuple[int, int]] = []
    for index, count in enumerate(slots):
        for local in range(count):
            if len(out) == n:
                return out
            out.append((index, local))
    return out


def _assign_rankfile(req: Request) -> list[tuple[int, int]]:
    names = [h.name for h in req.hosts]
    by_rank = dict(req.rankfile)
    if sorted(by_rank) != list(range(len(by_rank))):
        raise UsageError("rankfile: ranks must be 0..N-1 with none missing")
    if req.nproc is not None and req.nproc != len(by_rank):
        raise UsageError(f"rankfile has {len(by_rank)} ranks but -n is {req.nproc}")
    counts: dict[str, int] = {}
    out = []
    for rank in range(len(by_rank)):
        host = by_rank[rank]
        if host not in names:
            raise UsageError(f"rankfile: rank {rank} is on {host!r}, which is not in the hosts")
        out.append((names.index(host), counts.get(host, 0)))
        counts[host] = counts.get(host, 0) + 1
    return out


def parse_rankfile(lines: Sequence[str], source: str = "rankfile") -> tuple[tuple[int, str], ...]:
    """Open MPI rankfile lines ``rank N=host slot=...`` -> ((rank, host), ...)."""
    out = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"rank\s+([0-9]+)\s*=\s*(\S+)(?:\s+slot=\S+)?", line)
        if not m:
            raise UsageError(f"{source}:{lineno}: expected 'rank N=host slot=S', got {line!r}")
        out.append((int(m.group(1)), validate_hostname(m.group(2), f"{source}:{lineno}")))
    if not out:
        raise UsageError(f"{source}: no ranks found")
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """Where the ranks go: ``placement`` (host index in ``req.hosts``, local rank) in rank
    order; ``used`` the hosts that got ranks (the others drop out of the plan); with one
    ddlrun per node, ranks are offset by this node's share."""

    placement: tuple[tuple[int, int], ...]
    used: tuple[int, ...]
    local_size: tuple[int, ...]  # per used host
    offset: int
    world: int
    nnodes: int
    per_node: bool


def layout_of(req: Request, placement: Sequence[tuple[int, int]]) -> Layout:
    """The ``Layout`` of ``assign``'s placement (this node's, with one ddlrun per node)."""
    counts = Counter(h for h, _ in placement)
    used = tuple(sorted(counts))
    local_size = tuple(counts[h] for h in used)
    per_node = req.node_rank is not None
    nnodes = req.nnodes or 1
    return Layout(
        placement=tuple(placement),
        used=used,
        local_size=local_size,
        offset=req.node_rank * len(placement) if per_node else 0,
        world=len(placement) * nnodes if per_node else len(placement),
        nnodes=nnodes,
        per_node=per_node,
    )


def whole_job(layout: Layout) -> list[tuple[int, int]]:
    """Every rank of the job (all nodes when one ddlrun runs per node): what the grid of
    DDL_OPTIONS describes."""
    if not layout.per_node:
        return list(layout.placement)
    return [(n, local) for n in range(layout.nnodes) for _, local in layout.placement]
