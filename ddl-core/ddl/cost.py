"""The alpha-beta(-gamma) cost model: one formula per algorithm, shared by algorithm
selection (mode ``b``), calibration (mode ``p`` measures instead) and ddl-perf's simulator.

T = steps * alpha + bytes_on_the_wire * beta + bytes_reduced * gamma, per dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message step (latency + software overhead)
    beta: float  # seconds per byte on the wire
    gamma: float = 1 / 3e9  # seconds per byte reduced (one core's np.add)


# Defaults for a dimension before anything is measured.
SHARED_MEMORY = Link(alpha=10e-6, beta=1 / 5e9)
NETWORK = Link(alpha=150e-6, beta=1 / 1.0e9)


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def allreduce_time(alg: str, n: int, nbytes: float, link: Link) -> float:
    """Predicted time of an allreduce of ``nbytes`` over ``n`` ranks with algorithm ``alg``
    ('ring', 'hd' = recursive halving-doubling, 'native' = the engine's own, a ring)."""
    if n <= 1:
        return 0.0
    wire = 2 * (n - 1) / n * nbytes
    reduced = (n - 1) / n * nbytes
    if alg == "hd":
        if not is_pow2(n):
            return math.inf
        steps = 2 * math.log2(n)
    elif alg in ("ring", "native", "shm"):
        steps = 2 * (n - 1)
    else:
        raise ValueError(f"unknown algorithm {alg!r}")
    if alg == "native":
        # The engine's own collective (Gloo's, MPI's) overlaps reducing one piece with
        # receiving the next; ddl's ring and halving-doubling reduce between exchanges.
        # Measured on 2 hosts x 2 ranks at 1 Gbit/s: native 1.06-1.12x faster than hd.
        reduced = 0.0
    return steps * link.alpha + wire * link.beta + reduced * link.gamma


def reduce_scatter_time(alg: str, n: int, nbytes: float, link: Link) -> float:
    return allreduce_time(alg, n, nbytes, link) / 2


def best(candidates: list[str], n: int, nbytes: float, link: Link) -> str:
    return min(candidates, key=lambda a: (allreduce_time(a, n, nbytes, link), a))


def multidim_time(dims: list[tuple[str, int, Link]], nbytes: float) -> float:
    """DDL multi-dimensional allreduce without pipelining: reduce-scatter along each
    dimension in turn (each sees 1/(product of inner sizes) of the data), the outermost
    allreduce, then allgather back. ``dims`` = [(algorithm, size, link)], innermost first."""
    total = 0.0
    share = float(nbytes)
    for i, (alg, n, link) in enumerate(dims):
        if i == len(dims) - 1:
            total += allreduce_time(alg, n, share, link)
        else:
            total += 2 * reduce_scatter_time(alg, n, share, link)
            share /= n
    return total


def pipelined_time(dims: list[tuple[str, int, Link]], nbytes: float, chunks: int) -> float:
    """With the buffer cut into ``chunks`` pipelined through the dimensions, the slowest
    dimension sets the pace once the pipeline is full."""
    if chunks <= 1:
        return multidim_time(dims, nbytes)
    stage = [multidim_time(dims[: i + 1], nbytes) - multidim_time(dims[:i], nbytes)
             for i in range(len(dims))]
    return max(stage) + sum(stage) / chunks
