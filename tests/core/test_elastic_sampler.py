"""The elastic sampler's arithmetic (ddl.elastic.sampler): over any sequence of world changes
within an epoch, every index is processed exactly once, and the shares of a world differ
by at most one. A seeded random search over scenarios (hypothesis is not a dependency)."""

from __future__ import annotations

import random

import pytest

from ddl.elastic import sampler as S


def test_the_epoch_order_is_a_permutation_fixed_by_seed_and_epoch():
    assert S.epoch_order(5, epoch=3, shuffle=False) == [0, 1, 2, 3, 4]
    order = S.epoch_order(100, epoch=2, seed=7)
    assert sorted(order) == list(range(100))
    assert order == S.epoch_order(100, epoch=2, seed=7)  # every rank computes the same
    assert order != S.epoch_order(100, epoch=3, seed=7)
    assert S.epoch_order(100, epoch=3, seed=6) == S.epoch_order(100, epoch=2, seed=7)


def test_remaining_keeps_the_order_and_drops_the_processed():
    assert S.remaining([4, 1, 3, 0, 2], {1, 2}) == [4, 3, 0]
    assert S.remaining([4, 1, 3], [3]) == [4, 1]


def test_shares_are_dealt_in_turn_and_pad_repeats_the_first_indices():
    assert [S.share([9, 8, 7, 6, 5], r, 2) for r in range(2)] == [[9, 7, 5], [8, 6]]
    assert [S.share([9, 8, 7, 6, 5], r, 2, pad=True) for r in range(2)] == [[9, 7, 5],
                                                                           [8, 6, 9]]
    # padding longer than the list itself: 2 indices over 5 ranks
    assert [S.share([1, 2], r, 5, pad=True) for r in range(5)] == [[1], [2], [1], [2], [1]]
    assert [S.share([1, 2], r, 5) for r in range(5)] == [[1], [2], [], [], []]
    assert S.share([], 0, 3, pad=True) == []
    for bad in [(0, 0), (2, 2), (-1, 2)]:
        with pytest.raises(ValueError, match="0 <= rank < num_replicas"):
            S.share([1], *bad)


def test_share_length_matches_the_share():
    for n in range(12):
        for size in range(1, 6):
            for rank in range(size):
                for pad in (False, True):
                    got = len(S.share(list(range(n)), rank, size, pad=pad))
                    assert S.share_length(n, rank, size, pad=pad) == got, (n, rank, size, pad)


def test_a_batch_is_a_slice_of_the_share_and_the_last_may_be_short():
    share = [5, 3, 8, 1, 9]
    assert S.batch(share, 0, 2) == [5, 3]
    assert S.batch(share, 2, 2) == [9]
    assert S.batch(share, 3, 2) == []


def run_epoch(rng: random.Random, pad: bool = False) -> tuple[list[int], int]:
    """One epoch under random world changes: every rank of the current world processes
    some batches of its share (mostly as many as the others; the last ones may be short or
    empty), then either the world commits (the union of what was processed) or a rank is
    lost before the commit (that work is thrown away, as the restored model throws it
    away); then the world takes a new size from 1 to 8 and re-deals what is left. Returns
    every index processed by a committed round, with repeats, and the dataset's size."""
    n = rng.randrange(0, 80)
    order = S.epoch_order(n, epoch=rng.randrange(5), shuffle=rng.random() < 0.8,
                          seed=rng.randrange(100))
    committed: set[int] = set()
    seen: list[int] = []
    size = rng.randint(1, 8)
    for _ in range(10_000):
        left = S.remaining(order, committed)
        if not left:
            return seen, n
        shares = [S.share(left, rank, size, pad=pad) for rank in range(size)]
        lengths = [len(s) for s in shares]
        assert max(lengths) - min(lengths) <= (0 if pad else 1), lengths
        if not pad:
            assert sorted(i for s in shares for i in s) == sorted(left)
        batch_size = rng.randint(1, 6)
        most = -(-max(lengths) // batch_size)
        if rng.random() < 0.7:  # in step: every rank the same number of batches
            batches = [rng.randint(1, most)] * size
        else:  # uneven progress (ranks that joined early, record_indices of their own)
            batches = [rng.randint(0, most) for _ in range(size)]
        work = [i for s, k in zip(shares, batches) for b in range(k)
                for i in S.batch(s, b, batch_size)]
        if rng.random() < 0.2:  # a rank lost before the commit: back to the last one
            size = rng.randint(1, 8)
            continue
        seen += work
        committed |= set(work)
        if rng.random() < 0.5:
            size = rng.randint(1, 8)
    raise AssertionError("the epoch did not end")


@pytest.mark.parametrize("seed", range(20))
def test_every_index_is_processed_exactly_once_over_any_world_changes(seed):
    rng = random.Random(seed)
    for _ in range(50):
        seen, n = run_epoch(rng)
        assert sorted(seen) == list(range(n))


def test_with_pad_every_index_is_processed_at_least_once_and_shares_are_equal():
    rng = random.Random(1234)
    repeated = False
    for _ in range(200):
        seen, n = run_epoch(rng, pad=True)
        assert set(seen) == set(range(n))
        repeated |= len(seen) > n
    assert repeated  # Horovod's padding does repeat samples: the scenarios reach it
