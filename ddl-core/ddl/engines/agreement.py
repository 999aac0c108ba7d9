"""Settings that every rank must plan its collectives with alike, checked once at start.

A collective's steps follow from settings each rank reads for itself: the grid and its
modes (``DDL_OPTIONS``), the pipeline's chunk (``DDL_CHUNK_BYTES``), the links mode ``b``
and sub-groups price algorithms with (``DDL_COST_PROFILE``, a file on each host). Ranks
that read different values take different steps for the same call: they wait for messages
that never come, or pair unrelated pieces of data. So a job whose ranks disagree stops at
start, on every rank, naming the setting and the ranks that differ (the first rank that
differs from rank 0 of the group), instead of hanging in its first collective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import DDLConfigError
from .base import PeerGroup


@dataclass(frozen=True)
class Setting:
    """One setting as this rank reads it: ``word`` is what is compared (the value, or a
    digest of it), ``shown`` how this rank names it in the error, ``numeric`` whether the
    word is the value itself (the error then prints every rank's)."""

    name: str
    word: int
    shown: str
    numeric: bool = False


def number(name: str, value: int) -> Setting:
    return Setting(name, int(value), str(int(value)), numeric=True)


def digest(name: str, value: object, shown: str) -> Setting:
    """A setting compared by a 63-bit digest of ``repr(value)`` (the same on every host
    for the same floats, strings and tuples of them)."""
    h = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return Setting(name, int.from_bytes(h, "little") >> 1, shown)


def disagreement(settings: Sequence[Setting], rows: np.ndarray, members: Sequence[int],
                 me: int) -> str | None:
    """The error for the first setting whose word differs between ``rows`` (one row of
    words per member, in ``members``' order), or None when every row is the same. Pure:
    every member computes it from the same rows, so all raise alike."""
    for k, s in enumerate(settings):
        col = rows[:, k]
        if (col == col[0]).all():
            continue
        odd = [members[i] for i in np.flatnonzero(col != col[0]).tolist()]
        first = int(np.flatnonzero(col != col[0])[0])
        if s.numeric:
            theirs = (f"rank {members[0]} has {int(col[0])}, rank {members[first]} has "
                      f"{int(col[first])}")
        else:
            theirs = f"rank(s) {odd} read other values than rank {members[0]}"
        return (f"rank {me}: the ranks plan collectives with different {s.name} ({theirs}; "
                f"this rank: {s.shown}): every rank needs the same, or they would take "
                "different steps for the same call and hang or mix data")
    return None


def agree(group: PeerGroup, members: Sequence[int], settings: Sequence[Setting],
          me: int) -> None:
    """Compare ``settings`` across ``group`` (one allgather; ``members``: its ranks' global
    numbers); DDLConfigError on every member when some differ. Every member passes the
    same names in the same order."""
    mine = np.array([s.word for s in settings], np.int64)
    rows = np.zeros(group.size * mine.size, np.int64)
    group.allgather_bytes(mine, rows)
    why = disagreement(settings, rows.reshape(group.size, mine.size), members, me)
    if why:
        raise DDLConfigError(why)
