"""The arithmetic of elastic sampling, framework-free: which indices of an epoch are left
after the ones already processed, how they are split over the ranks of the current world,
and which indices a batch covers. ``ddl.torch.elastic.ElasticSampler`` is a thin torch
``Sampler`` over these functions.

The rule (it differs from Horovod's, which pads every re-sharding by repeating indices):
the indices the world has not processed yet this epoch, in the epoch's order, are dealt to
the ranks in turn (rank ``r`` takes positions ``r, r + size, ...``), so the shares differ by
at most one and, over any sequence of world changes, every index is processed exactly once.
``pad=True`` keeps Horovod's rule for loops that need every rank to run the same number of
batches: the first indices are repeated until every share has the same length.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence


def epoch_order(num_samples: int, epoch: int, shuffle: bool = True, seed: int = 0) -> list[int]:
    """The order of the epoch: ``0..num_samples-1``, shuffled with ``seed + epoch`` (every
    rank computes the same permutation, so no rank needs to send it)."""
    order = list(range(num_samples))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


def remaining(order: Sequence[int], processed: Collection[int]) -> list[int]:
    """The indices of ``order`` not yet processed, in the epoch's order."""
    done = processed if isinstance(processed, (set, frozenset)) else set(processed)
    return [index for index in order if index not in done]


def share(indices: Sequence[int], rank: int, num_replicas: int, pad: bool = False) -> list[int]:
    """Rank ``rank``'s part of ``indices`` in a world of ``num_replicas`` ranks: every
    ``num_replicas``-th index from position ``rank``. Without ``pad`` the parts differ in
    length by at most one and together hold each index once; with ``pad`` the first indices
    are repeated so that every part has ``ceil(len / num_replicas)`` of them."""
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} of {num_replicas} replicas: expected 0 <= rank < "
                         f"num_replicas and num_replicas >= 1")
    dealt = list(indices)
    if pad and dealt:
        total = share_length(len(dealt), 0, num_replicas, pad=True) * num_replicas
        while len(dealt) < total:  # a loop: the padding can exceed len(indices) itself
            dealt += dealt[:total - len(dealt)]
    return dealt[rank::num_replicas]


def share_length(num_indices: int, rank: int, num_replicas: int, pad: bool = False) -> int:
    """``len(share(...))`` without building it."""
    if pad:
        return -(-num_indices // num_replicas)
    return num_indices // num_replicas + (1 if rank < num_indices % num_replicas else 0)


def batch(indices: Sequence[int], batch_idx: int, batch_size: int) -> list[int]:
    """The indices batch ``batch_idx`` of ``batch_size`` covers in a rank's share (the last
    batch may be shorter; past the end, none)."""
    start = batch_idx * batch_size
    return list(indices[start:start + batch_size])
