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

    def describe(self, nbytes: int = 0) -> str:
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


class GroupDim:
    """A dimension across hosts: a Gloo (or MPI) group and the algorithm its mode picks:
    'r' ring, 'n' the engine's native collectives, 'b' the cost model's pick per message
    size, 'p' whichever was fastest when measured at start (``explore``)."""

    def __init__(self, group, index: int, mode: str, link: cost.Link = cost.NETWORK):
        self.group = group
        self.index = index
        self.size = group.size
        self.rank = group.rank
        self.mode = mode
        self.link = link
        self.fixed = {"r": "ring", "n": "native"}.get(mode)

    def candidates(self) -> list[str]:
        return ["ring", "native"] + (["hd"] if cost.is_pow2(self.size) else [])

    def choose(self, nbytes: int) -> str:
        if self.fixed:
            return self.fixed
        return cost.best(self.candidates(), self.size, nbytes, self.link)

    def describe(self, nbytes: int = 1 << 20) -> str:
        return f"dim{self.index} x{self.size} {self.group.name}/{self.choose(nbytes)}"

    def _alg(self, nbytes: int, dt: DType) -> str:
        alg = self.choose(nbytes)
        if alg == "native" and not self.group.native_ok(dt):
            return "ring"  # e.g. complex or uint16: ddl's own reduction handles them
        return alg

    def reduce_scatter(self, buf: np.ndarray, counts: list[int], dt: DType, op: ReduceOp) -> None:
        alg = self._alg(buf.nbytes, dt)
        if alg == "native":
            self.group.allreduce(buf, dt, op)  # every segment reduced; ours is what counts
        elif alg == "hd":
            ring.hd_reduce_scatter(self.group, buf, counts, dt, op)
        else:
            ring.ring_reduce_scatter(self.group, buf, counts, dt, op)

    def allgather(self, buf: np.ndarray, counts: list[int], dt: DType) -> None:
        alg = self._alg(buf.nbytes, dt)
        if alg == "hd":
            ring.hd_allgather(self.group, buf, counts)
        elif alg == "native" and len(set(counts)) == 1:
            o = counts[0] * self.rank
            mine = buf[o : o + counts[0]].copy()
            self.group.allgather_bytes(mine, buf)
        else:
            ring.ring_allgather(self.group, buf, counts)

    def allreduce(self, buf: np.ndarray, dt: DType, op: ReduceOp) -> None:
        if self._alg(buf.nbytes, dt) == "native":
            self.group.allreduce(buf, dt, op)
            return
        counts = even_split(buf.size, self.size)
        self.reduce_scatter(buf, counts, dt, op)
        self.allgather(buf, counts, dt)

    def explore(self, dt: DType, nbytes: int = 1 << 20, reps: int = 3) -> dict[str, float]:
        """Mode 'p': time every candidate here, agree on the times (the max over the
        group, so every member decides alike) and keep the fastest."""
        buf = np.zeros(max(1, nbytes // dt.itemsize), dt.storage)
        times = {}
        for alg in self.candidates():
            self.fixed = alg
            self.allreduce(buf, dt, ReduceOp.SUM)  # warm-up, connections
            t = time.perf_counter()
            for _ in range(reps):
                self.allreduce(buf, dt, ReduceOp.SUM)
            times[alg] = (time.perf_counter() - t) / reps
        agreed = np.array([times[a] for a in self.candidates()], np.float64)
        self.fixed = "native"
        self.group.allreduce(agreed, BY_NAME["float64"], ReduceOp.MAX)
        times = dict(zip(self.candidates(), agreed.tolist(), strict=True))
        self.fixed = min(times, key=lambda a: (times[a], a))
        return times

    def close(self) -> None:
        self.group.close()

