"""The learner grid: how the job's ranks decompose into dimensions (IBM DDL's X x Y x Z:
ranks in a host, hosts in a rack, racks). Pure planning, no I/O.

Ranks are numbered host by host (ddlrun places them so), so with ``dims = (d0, d1, ...)``,
innermost first, rank ``r`` has coordinates ``c0 = r % d0``, ``c1 = (r // d0) % d1``, ...
A *line* of dimension k is the set of ranks that differ only in coordinate k; a collective
along dimension k runs independently on every line of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import DDLConfigError
from .options import Options


def even_split(n_items: int, n_parts: int) -> list[int]:
    """``n_items`` in ``n_parts`` counts as even as possible, the larger ones first (lower
    ranks get the extra item). The one rule for every split of rows or elements over ranks:
    reduce_scatter's dimension 0, the ring's segments, Horovod's ``num_groups``."""
    base, extra = divmod(n_items, n_parts)
    return [base + 1] * extra + [base] * (n_parts - extra)


def chunk_sizes(n: int, chunk: int, ramp: int = 3) -> list[int]:
    """Chunk lengths for a pipeline over ``n`` elements: ``chunk`` in the middle, and at each
    end up to ``ramp`` chunks halving in size (..., chunk/4, chunk/2). Nothing crosses the
    slow link until the first chunk is through the inner dimensions, and the last chunk's
    allgather runs after the link is done: small end chunks shorten that fill and drain,
    while full-size chunks in the middle keep the per-operation cost low."""
    chunk = max(1, chunk)
    if n <= chunk:
        return [n]
    while ramp:
        ends = [max(1, chunk >> (k + 1)) for k in range(ramp)][::-1]  # chunk/4, chunk/2
        middle = n - 2 * sum(ends)
        if middle >= chunk // 2:
            return ends + even_split(middle, -(-middle // chunk)) + ends[::-1]
        ramp -= 1
    return even_split(n, -(-n // chunk))


@dataclass(frozen=True)
class Dim:
    index: int
    size: int
    members: tuple[int, ...]  # global ranks of this rank's line, in coordinate order
    position: int  # this rank's index in members
    line_id: int  # which line of this dimension (same on every member)
    intra_host: bool  # every member on this rank's host: the shared-memory engine can run it
    mode: str  # 'r', 'n', 'b' or 'p'


@dataclass(frozen=True)
class Grid:
    dims: tuple[Dim, ...]
    world: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)

    def describe(self) -> str:
        parts = [f"{d.size}{'(host)' if d.intra_host else ''}:{d.mode}" for d in self.dims]
        return " x ".join(parts)


def default_dims(world: int, local_size: int) -> tuple[int, ...]:
    """Ranks per host x hosts, dropping dimensions of size 1."""
    if local_size < 1 or world % local_size:
        return (world,)
    dims = tuple(d for d in (local_size, world // local_size) if d > 1)
    return dims or (1,)


def plan(rank: int, world: int, local_size: int, opts: Options) -> Grid:
    """This rank's lines in every dimension of the grid that ``opts`` describe (or the
    default: one flat dimension when no -mode grid is given)."""
    dims = opts.grid if opts.grid is not None else (world,)
    if math.prod(dims) != world:
        raise DDLConfigError(
            f"-mode {opts.mode}:{'x'.join(map(str, dims))} describes {math.prod(dims)} ranks "
            f"but the job has {world}"
        )
    letters = opts.mode if len(opts.mode) == len(dims) else opts.mode[0] * len(dims)
    homogeneous = local_size >= 1 and world % local_size == 0
    host = rank // local_size if homogeneous else rank
    out = []
    stride = 1
    for k, size in enumerate(dims):
        coord = (rank // stride) % size
        base = rank - coord * stride
        members = tuple(base + i * stride for i in range(size))
        # the line's id: the rank with coordinate 0, which is unique per line
        intra = homogeneous and all(m // local_size == host for m in members)
        out.append(Dim(k, size, members, coord, base, intra, letters[k]))
        stride *= size
    return Grid(tuple(out), world)


def host_line(grid: Grid, rank: int, local_size: int) -> tuple[tuple[int, ...], int] | None:
    """The ranks at this rank's place on every host (members, this rank's position), when
    one dimension of ``grid`` is exactly this host's ranks and every other one crosses
    hosts: the line along which the identity round gathers one row per host
    (engines/identity_round.py) instead of one per rank. None on any other grid."""
    dims = [d for d in grid.dims if d.size > 1]
    inside = [d for d in dims if d.intra_host]
    if (local_size < 2 or grid.world % local_size or len(inside) != 1
            or inside[0].size != local_size):
        return None
    here = rank % local_size
    return tuple(h * local_size + here for h in range(grid.world // local_size)), \
        rank // local_size
