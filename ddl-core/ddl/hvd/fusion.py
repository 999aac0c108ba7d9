"""Fusion-buffer planning for the DistributedOptimizer: pure, framework-free, unit-tested.

Horovod fuses, in each background cycle (``HOROVOD_CYCLE_TIME``, 1 ms), the gradients that
are ready, up to ``HOROVOD_FUSION_THRESHOLD`` bytes (128 MiB) of one dtype. Its coordinator
makes every rank agree on which tensors go together. The ddl core has no coordinator:
collectives must be issued in the same order with the same shapes on every rank. So the
plan is fixed data that every rank holds identically:

- before timings exist, gradients are grouped in reverse registration order (the order
  backward usually produces them) up to the threshold;
- once one backward pass has been timed (on rank 0, broadcast to all), gradients that became
  ready within one cycle of a bucket's first gradient share that bucket, up to the
  threshold: Horovod's rule, decided once instead of every cycle.

Buckets are launched strictly in plan order, so every rank issues the same sequence even
when its hooks fire in a different order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ..errors import DDLConfigError
from ..grid import even_split

DEFAULT_THRESHOLD_BYTES = 128 << 20  # Horovod >= 0.21
DEFAULT_CYCLE_TIME_MS = 1.0  # Horovod >= 0.21


@dataclass(frozen=True)
class Bucket:
    """Tensors fused into one buffer: ``members[i]`` lives at ``offsets[i]`` (elements)."""

    key: Hashable  # what must match to share a buffer (dtype, device)
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int


def _bucket(key: Hashable, members: list[int], numels: Sequence[int]) -> Bucket:
    offsets, off = [], 0
    for m in members:
        offsets.append(off)
        off += numels[m]
    return Bucket(key, tuple(members), tuple(offsets), off)


def plan_buckets(
    numels: Sequence[int],
    itemsizes: Sequence[int],
    keys: Sequence[Hashable],
    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
    *,
    ready_times: Sequence[float] | None = None,
    cycle_time_s: float = 0.0,
) -> list[Bucket]:
    """Group tensors ``0..n-1`` into fusion buckets.

    ``numels``/``itemsizes``/``keys`` describe each tensor as it is sent (after
    compression). Without ``ready_times`` tensors are taken in reverse index order; with
    them, in order of readiness (ties by reverse index), and a bucket also closes when a
    tensor is ready more than ``cycle_time_s`` after the bucket's first (``0``: no limit).
    ``threshold_bytes <= 0`` disables fusion (one tensor per bucket). A tensor larger than
    the threshold gets a bucket of its own. Buckets come back in launch order.
    """
    n = len(numels)
    if not (len(itemsizes) == len(keys) == n):
        raise ValueError("numels, itemsizes and keys must have the same length")
    if ready_times is not None and len(ready_times) != n:
        raise ValueError(f"ready_times has {len(ready_times)} entries for {n} tensors")
    order = list(range(n - 1, -1, -1))
    if ready_times is not None:
        order.sort(key=lambda i: (ready_times[i], -i))
    # One open bucket per key: a float32 and a float16 gradient never share a buffer, and
    # interleaved dtypes must not cut each other's buckets short.
    open_: dict[Hashable, tuple[list[int], int, float, int]] = {}  # key -> members, bytes, t0, rank
    closed: list[tuple[int, Bucket]] = []  # (position of first member, bucket)
    for pos, i in enumerate(order):
        key, nbytes = keys[i], numels[i] * itemsizes[i]
        t = ready_times[i] if ready_times is not None else 0.0
        cur = open_.get(key)
        if cur is not None:
            members, size, t0, first = cur
            too_big = threshold_bytes <= 0 or size + nbytes > threshold_bytes
            too_late = ready_times is not None and cycle_time_s > 0 and t - t0 > cycle_time_s
            if too_big or too_late:
                closed.append((first, _bucket(key, members, numels)))
                cur = None
        if cur is None:
            open_[key] = ([i], nbytes, t, pos)
        else:
            members.append(i)
            open_[key] = (members, size + nbytes, t0, first)
    for key, (members, _, _, first) in open_.items():
        closed.append((first, _bucket(key, members, numels)))
    closed.sort(key=lambda fb: fb[0])
    return [b for _, b in closed]


def plan_groups(groups: Sequence[Sequence[int]], numels: Sequence[int],
                keys: Sequence[Hashable]) -> list[Bucket]:
    """Buckets from explicit groups (Horovod's ``groups=``/``num_groups=``), split by key."""
    out: list[Bucket] = []
    for g in groups:
        by_key: dict[Hashable, list[int]] = {}
        for i in g:
            by_key.setdefault(keys[i], []).append(i)
        out.extend(_bucket(k, m, numels) for k, m in by_key.items())
    return out


def split_evenly(n: int, num_groups: int) -> list[list[int]]:
    """Horovod's ``num_groups``: indices ``0..n-1`` in ``num_groups`` contiguous groups."""
    if num_groups <= 0:
        raise DDLConfigError(f"num_groups must be positive, got {num_groups}")
    num_groups = min(num_groups, max(n, 1))
    sizes = even_split(n, num_groups)
    out, start = [], 0
    for s in sizes:
        out.append(list(range(start, start + s)))
        start += s
    return [g for g in out if g]
