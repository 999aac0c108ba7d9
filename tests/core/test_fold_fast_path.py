"""The shared-memory engine's fast test of a folded identity (one comparison per peer of
the record's head word, which holds the flag, and the agreed words): it must take the data
step only when every rank folded the same call. Two local ranks as two threads of this
process, each with its own engine on one control segment."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import ddl
from ddl import dtypes
from ddl.engines.shm import ShmEngine
from ddl.engines.shm_meta import Fold, Unfolded

F32 = dtypes.BY_NAME["float32"]
AGREED = 4  # words of the descriptors below that every rank must agree on


def _never(result: np.ndarray) -> bool:
    return False


def _desc(seq: int, failed: int = 0) -> np.ndarray:
    return np.array([7, 1, seq, 256, failed, 0], dtype=np.int64)  # agreed words, then info


def _pair(tag: str) -> list[ShmEngine]:
    job = f"fold{os.getpid()}{tag}"
    engines: list[ShmEngine | None] = [None, None]

    def make(rank: int) -> None:
        engines[rank] = ShmEngine(job_id=job, host_index=0, local_rank=rank, local_size=2,
                                  global_rank=rank, heap_bytes=1 << 20, token=1, timeout=20.0)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(e is not None for e in engines), "the engines did not attach"
    return engines


def _both(engines: list[ShmEngine], steps: list) -> list:
    """Run ``steps[rank](engine)`` on both ranks at once; each rank's result or error."""
    out: list = [None, None]

    def run(rank: int) -> None:
        try:
            out[rank] = steps[rank](engines[rank])
        except Exception as exc:  # noqa: BLE001 - the test compares them
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _folded(fold: Fold, seq: int):
    def step(engine: ShmEngine) -> object:
        fold.words[2] = seq  # patched per call, as negotiate patches its sequence number
        x = np.full(256, 1.0 + engine.rank, np.float32)
        engine.fold_identity(fold)
        try:
            engine.allreduce(x, x, F32, ddl.Sum, x.shape)
        finally:
            left = engine.cancel_fold()
        return ("moved", float(x[0]), left is None)
    return step


def _plain(engine: ShmEngine) -> object:
    x = np.ones(256, np.float32)
    engine.allreduce(x, x, F32, ddl.Sum, x.shape)
    return ("moved", float(x[0]))


@pytest.fixture
def engines(request):
    pair = _pair(request.node.name[-6:].replace("_", "x").replace("[", "").replace("]", ""))
    yield pair
    for e in pair:
        e.close()


def test_the_same_call_on_every_rank_moves_its_data_in_the_first_step(engines):
    folds = [Fold(_desc(0), _never, AGREED) for _ in engines]
    for seq in range(3):  # both parities, then a reused fold at the first one
        got = _both(engines, [_folded(folds[0], seq), _folded(folds[1], seq)])
        assert got == [("moved", 3.0, True), ("moved", 3.0, True)]


def test_a_rank_that_exchanges_the_same_words_alone_is_not_taken_for_a_folded_one(engines):
    # a call that failed on rank 1 after planning: the same agreed words, exchanged alone
    fold = Fold(_desc(0), _never, AGREED)
    got = _both(engines, [_folded(fold, 0), lambda e: e.exchange_identity(_desc(0, 1))])
    assert isinstance(got[0], Unfolded)
    assert got[0].result.tolist() == _desc(0, 1).tolist() == got[1].tolist()


def test_a_stale_identity_equal_to_ours_does_not_hide_a_core_call(engines):
    folds = [Fold(_desc(5), _never, AGREED) for _ in engines]
    assert _both(engines, [_folded(folds[0], 5), _folded(folds[1], 5)])[0][0] == "moved"
    assert _both(engines, [_plain, _plain]) == [("moved", 2.0), ("moved", 2.0)]
    # Same parity as the first step: rank 1's record still holds the very descriptor rank 0
    # folds now, but rank 1 runs a core call: both ranks raise, nothing is reduced.
    got = _both(engines, [_folded(folds[0], 5), _plain])
    for err in got:
        assert isinstance(err, ddl.DDLMismatchError)
        assert "core ddl call" in str(err)


def test_a_fold_is_checked_once_when_it_is_made():
    with pytest.raises(ddl.DDLConfigError, match="at most"):
        Fold(np.zeros(200, dtype=np.int64), _never, 0)
    with pytest.raises(ddl.DDLConfigError, match="compares at most"):
        Fold(_desc(0), _never, 7)
