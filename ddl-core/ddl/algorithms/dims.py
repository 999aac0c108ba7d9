"""One dimension of the grid as the multi-dimensional allreduce sees it: reduce-scatter a
buffer into this rank's segment, allgather the segments back, or allreduce, on whichever
engine and algorithm runs that dimension."""

from __future__ import annotations

import time

import numpy as np

from .. import cost
from ..dtypes import BY_NAME, DType
from ..grid import even_split
from ..ops import ReduceOp
from . import ring


class ShmDim:
    """A dimension whose ranks share a host: the shared-memory engine."""

    def __init__(self, engine, index: int):
        self.engine = engine
        self.index = index
        self.size = engine.size
        self.rank = engine.rank
        self.algorithm = "shm"

    def describe(self, nbytes: int | None = None) -> str:
        return f"dim{self.index} x{self.size} shm"

    def reduce_scatter(self, buf: np.ndarray, counts: list[int], dt: DType, op: ReduceOp) -> None:
        o = sum(counts[: self.rank])
        self.engine.reduce_scatter(buf, buf[o : o + counts[self.rank]], dt, op, (buf.size,), counts)

    def allgather(self, buf: np.ndarray, counts: list[int], dt: DType) -> None:
        o = sum(counts[: self.rank])
        self.engine.allgather(buf[o : o + counts[self.rank]], dt, (), lambda _counts: buf)

    def allreduce(self, buf: np.ndarray, dt: DType, op: ReduceOp) -> None:
        self.engine.allreduce(buf, buf, dt, op, (buf.size,))

    def close(self) -> None:
        self.engine.close()


# Mode 'p' times every candidate at these sizes; a call takes the pick of the nearest (the
# bound between them is their geometric mean, 181 KiB). Smaller allreduces ride on the
# identity round (engines/identity_round.FOLD_BYTES), not on a dimension's algorithm.
EXPLORE_SIZES = (32 << 10, 1 << 20)
# With two engines on the dimension (Gloo beside MPI) a third, where the link's bandwidth
# rules: across two hosts at 1 Gbit/s the engines are within 15% at 1 MiB and 1.5x apart
# at 16 MiB, so 1 MiB's pick does not say which streams faster (1 MiB's pick then holds up
# to 2.8 MiB, 8 MiB's above).
EXPLORE_SIZES_TWO_ENGINES = (32 << 10, 1 << 20, 8 << 20)


class GroupDim:
    """A dimension across hosts: a Gloo (or MPI) group and the algorithm its mode picks:
    'r' ring, 'n' the engine's native collectives, 'b' the cost model's pick per message
    size, 'p' the fastest per size range when measured at start (``explore``).

    ``second``: another engine's group of the same ranks (Gloo beside MPI under mpirun) and
    its link; modes 'b' and 'p' may then pick its native collective (``"gloo:native"``) per
    size range. Mode 'b' prices it only with a measured link (``second_link``: from
    DDL_COST_PROFILE, else None), since the defaults cannot tell two engines apart."""

    def __init__(self, group, index: int, mode: str, link: cost.Link = cost.NETWORK,
                 second=None, second_link: cost.Link | None = None):
        self.group = group
        self.index = index
        self.size = group.size
        self.rank = group.rank
        self.mode = mode
        self.link = link
        self.second = second
        self.second_link = second_link
        self.fixed = {"r": "ring", "n": "native"}.get(mode)
        # mode 'p' after explore(): (largest size in bytes, algorithm), by size; the last
        # range is open
        self.picks: list[tuple[int, str]] = []

    def candidates(self) -> list[str]:
        own = ["ring", "native"] + (["hd"] if cost.is_pow2(self.size) else [])
        if self.second is not None and (self.mode == "p" or self.second_link is not None):
            own.append(f"{self.second.name}:native")
        return own

    def _price(self, alg: str, nbytes: int) -> float:
        base, second = self._split(alg)
        link = self.second_link if second else self.link
        return cost.allreduce_time(base, self.size, nbytes, link)

    def choose(self, nbytes: int) -> str:
        if self.fixed:
            return self.fixed
        if self.picks:
            for bound, alg in self.picks:
                if nbytes <= bound:
                    return alg
            return self.picks[-1][1]
        return min(self.candidates(), key=lambda a: (self._price(a, nbytes), *self._tie(a)))

    def _tie(self, alg: str) -> tuple[bool, str]:
        """Equal times go to the job's own engine, then by name: the same on every rank."""
        return self._split(alg)[1], alg

    def _split(self, alg: str) -> tuple[str, bool]:
        """(the algorithm, whether it runs on the second engine's group)."""
        engine, _, base = alg.rpartition(":")
        return base, bool(engine)

    def describe(self, nbytes: int | None = None) -> str:
        """The algorithm for ``nbytes``; without it mode 'p''s choice per size range once
        explored (``-dbg_level`` logs it), else the choice at 1 MiB."""
        head = f"dim{self.index} x{self.size} {self.group.name}"
        if self.second is not None:
            head += f"+{self.second.name}"
        if nbytes is None and self.picks and not self.fixed:
            lo, parts = 0, []
            for bound, alg in self.picks[:-1]:
                parts.append(f"{alg} to {bound} B")
                lo = bound + 1
            parts.append(f"{self.picks[-1][1]} from {lo} B")
            return f"{head}/[{', '.join(parts)}]"
        return f"{head}/{self.choose(1 << 20 if nbytes is None else nbytes)}"

    def _alg(self, nbytes: int, dt: DType):
        """(group, algorithm) for a message of ``nbytes`` of ``dt``."""
        base, second = self._split(self.choose(nbytes))
        group = self.second if second else self.group
        if base == "native" and not group.native_ok(dt):
            return self.group, "ring"  # e.g. complex or uint16: ddl's own reduction handles them
        return group, base

    def reduce_scatter(self, buf: np.ndarray, counts: list[int], dt: DType, op: ReduceOp) -> None:
        group, alg = self._alg(buf.nbytes, dt)
        if alg == "native":
            group.allreduce(buf, dt, op)  # every segment reduced; ours is what counts
        elif alg == "hd":
            ring.hd_reduce_scatter(group, buf, counts, dt, op)
        else:
            ring.ring_reduce_scatter(group, buf, counts, dt, op)

    def allgather(self, buf: np.ndarray, counts: list[int], dt: DType) -> None:
        group, alg = self._alg(buf.nbytes, dt)
        if alg == "hd":
            ring.hd_allgather(group, buf, counts)
        elif alg == "native" and len(set(counts)) == 1:
            o = counts[0] * self.rank
            mine = buf[o : o + counts[0]].copy()
            group.allgather_bytes(mine, buf)
        else:
            ring.ring_allgather(group, buf, counts)

    def allreduce(self, buf: np.ndarray, dt: DType, op: ReduceOp) -> None:
        group, alg = self._alg(buf.nbytes, dt)
        if alg == "native":
            group.allreduce(buf, dt, op)
            return
        counts = even_split(buf.size, self.size)
        self.reduce_scatter(buf, counts, dt, op)
        self.allgather(buf, counts, dt)

    def _time(self, alg: str, buf: np.ndarray, dt: DType, reps: int) -> float:
        """Seconds per allreduce of ``buf`` with ``alg`` on this rank (after a warm-up)."""
        self.fixed = alg
        try:
            self.allreduce(buf, dt, ReduceOp.SUM)  # warm-up, connections
            t = time.perf_counter()
            for _ in range(reps):
                self.allreduce(buf, dt, ReduceOp.SUM)
            return (time.perf_counter() - t) / reps
        finally:
            self.fixed = None

    def explore(self, dt: DType, sizes: tuple[int, ...] | None = None, reps: int = 3
                ) -> dict[int, dict[str, float]]:
        """Mode 'p': time every candidate at each of ``sizes``, agree on the times (the
        max over the group: every member then picks alike from the same numbers, whatever
        its own clock said) and keep the fastest per size range. Returns the agreed
        seconds, size -> algorithm -> seconds."""
        if sizes is None:
            sizes = EXPLORE_SIZES if self.second is None else EXPLORE_SIZES_TWO_ENGINES
        cands = self.candidates()
        local = []
        for nbytes in sizes:
            buf = np.zeros(max(1, nbytes // dt.itemsize), dt.storage)
            n = reps if nbytes >= 1 << 20 else reps * 10  # small calls: noise per call
            local += [self._time(alg, buf, dt, n) for alg in cands]
        agreed = np.array(local, np.float64)
        self.fixed = "native"
        try:
            self.group.allreduce(agreed, BY_NAME["float64"], ReduceOp.MAX)
        finally:
            self.fixed = None
        table: dict[int, dict[str, float]] = {}
        picks = []
        for i, nbytes in enumerate(sizes):
            times = dict(zip(cands, agreed[i * len(cands):(i + 1) * len(cands)].tolist(),
                             strict=True))
            table[nbytes] = times
            bound = int((nbytes * sizes[i + 1]) ** 0.5) if i + 1 < len(sizes) else nbytes
            picks.append((bound, min(times, key=lambda a: (times[a], *self._tie(a)))))
        self.picks = picks
        return table

    def close(self) -> None:
        try:
            self.group.close()
        finally:
            if self.second is not None:
                self.second.close()

