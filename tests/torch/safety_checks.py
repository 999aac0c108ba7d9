"""What the ``shutdown`` and ``cycles`` parts of workers/hvd_safety.py must report, on one
host (test_torch_safety.py) and across hosts (tests/multi/test_reinit.py) alike."""

from __future__ import annotations


def check_shutdown(n: int, reps: list[dict]) -> None:
    """A rank shut down while the others entered a collective: they raise naming it, and
    after init() again every rank is in step, within the timeout."""
    for rank, r in enumerate(reps):
        s = r["shutdown"]
        assert "error" not in s, s.get("error")
        for quitter in sorted({0, n - 1}):
            if rank != quitter:
                got = s[f"quit{quitter}_peer_error"]
                assert got["type"] == "DDLMismatchError", got
                assert f"rank {quitter}: hvd.shutdown()" in got["msg"], got
            assert s[f"quit{quitter}_in_step"], (rank, quitter)
            assert s[f"quit{quitter}_seconds"] < 20, s


def check_cycles(reps: list[dict]) -> None:
    """Twenty shutdown/init cycles with collectives between: per cycle the collectives were
    right, and (from the second shutdown on) threads, file descriptors and this rank's
    /dev/shm segments are back where they were."""
    for r in reps:
        c = r["cycles"]
        assert "error" not in c, c.get("error")
        assert c["checked"] == [True] * 39, c["checked"]
        assert c["shm_left"] == []
