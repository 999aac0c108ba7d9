"""Bandwidth-optimal ring and latency-optimal recursive halving-doubling, over a group's
``sendrecv``. Reductions use ddl's kernel, so every dtype works and each element is reduced
by exactly one rank (its segment's owner) and then copied: results are bitwise identical.

Segments: ``counts[j]`` elements at ``offsets[j]`` belong to group rank ``j``.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..ops import ReduceOp, reduce_into


def offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts[:-1]:
        out.append(out[-1] + c)
    return out


def ring_reduce_scatter(g, buf: np.ndarray, counts: list[int], dt: DType, op: ReduceOp) -> None:
    """Afterwards ``buf``'s segment ``g.rank`` holds the reduction (other segments: scratch)."""
    n, r = g.size, g.rank
    if n == 1:
        return
    offs = offsets(counts)
    seg = lambda j: buf[offs[j] : offs[j] + counts[j]]
    tmp = np.empty(max(counts), buf.dtype)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        si, ri = (r - s - 1) % n, (r - s - 2) % n
        t = tmp[: counts[ri]]
        g.sendrecv(seg(si), right, t, left)
        reduce_into(seg(ri), [seg(ri), t], op, dt)


def ring_allgather(g, buf: np.ndarray, counts: list[int]) -> None:
    """Every segment from its owner to everyone; segment ``g.rank`` is already in place."""
    n, r = g.size, g.rank
    offs = offsets(counts)
    seg = lambda j: buf[offs[j] : offs[j] + counts[j]]
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        si, ri = (r - s) % n, (r - s - 1) % n
        g.sendrecv(seg(si), right, seg(ri), left)


def hd_reduce_scatter(g, buf: np.ndarray, counts: list[int], dt: DType, op: ReduceOp) -> None:
    """Recursive halving (power-of-two group sizes): log2(n) exchanges instead of n - 1."""
    n, r = g.size, g.rank
    offs = offsets(counts) + [offs_end(counts)]
    lo, hi = 0, n
    d = n // 2
    tmp = np.empty(offs[n], buf.dtype) if n > 1 else None
    while d >= 1:
        mid = (lo + hi) // 2
        partner = r ^ d
        if r & d:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        kept = buf[offs[keep[0]] : offs[keep[1]]]
        t = tmp[: kept.size]
        g.sendrecv(buf[offs[give[0]] : offs[give[1]]], partner, t, partner)
        reduce_into(kept, [kept, t], op, dt)
        lo, hi = keep
        d //= 2


def hd_allgather(g, buf: np.ndarray, counts: list[int]) -> None:
    n, r = g.size, g.rank
    offs = offsets(counts) + [offs_end(counts)]
    d = 1
    lo, hi = r, r + 1
    while d < n:
        partner = r ^ d
        plo = lo - d if r & d else lo + d
        phi = plo + (hi - lo)
        g.sendrecv(buf[offs[lo] : offs[hi]], partner, buf[offs[plo] : offs[phi]], partner)
        lo, hi = min(lo, plo), max(hi, phi)
        d *= 2


def offs_end(counts: list[int]) -> int:
    return sum(counts)
