"""The DDL multi-dimensional allreduce ("multi-ring").

Reduce-scatter along dimension 0 (ranks in a host), then along dimension 1 on the segment
that is left (1/d0 of the data), ..., allreduce along the outermost dimension, then allgather
back in reverse. The slow outer links carry only 1/(d0 x d1 ...) of the bytes.

The buffer is cut into chunks pipelined through the dimensions: one thread per dimension,
each running a fixed schedule (reduce-scatter chunk i, then allgather chunk i-1), so chunk
i+1's intra-host work overlaps chunk i's transfer across hosts while every engine still sees
the same sequence of operations on every rank. Engines release the GIL while they move data.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from .. import timeline as _tl
from ..config import CHUNK_MIN
from ..dtypes import DType
from ..errors import DDLTimeoutError
from ..grid import chunk_sizes, even_split
from ..ops import ReduceOp, reduce_into

_log = logging.getLogger("ddl")


def chunk_plan(n: int, dims, chunk_elems: int) -> list[list[tuple[int, int, list[int]]]]:
    """Cut ``n`` elements into chunks (``chunk_sizes``); for each chunk, what each dimension
    works on: (start, end, block counts over its ranks), where dimension j+1 works on this
    rank's block of dimension j. Pure: the host and device engines share it."""
    out = []
    a = 0
    for size in chunk_sizes(n, chunk_elems):
        b = a + size
        start = a
        segs = []
        for d in dims:
            c = even_split(b - a, d.size)
            segs.append((a, b, c))
            a += sum(c[: d.rank])
            b = a + c[d.rank]
        out.append(segs)
        a = start + size
    return out


class MultiDim:
    def __init__(self, dims: list, world_size: int, rank: int, *, chunk_bytes: int,
                 timeout: float, dump_iter: int = 0, label: str = ""):
        self.dims = [d for d in dims if d.size > 1]
        self.world = world_size
        self.rank = rank
        self.chunk_bytes = max(CHUNK_MIN, chunk_bytes)
        self.timeout = timeout
        self.dump_iter = dump_iter
        self.label = label
        self._calls = 0
        self._busy = [0.0] * len(self.dims)
        self._wall = 0.0

    def describe(self, nbytes: int | None = None) -> str:
        return " -> ".join(d.describe(nbytes) for d in self.dims) or "single rank"

    # -------------------------------------------------------------------------
    def allreduce(self, buf: np.ndarray, dt: DType, op: ReduceOp) -> None:
        """In place on a flat array; results bitwise identical on every rank."""
        t0 = time.perf_counter()
        inner = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
        if len(self.dims) == 1:
            self._timed(0, self.dims[0].allreduce, buf, dt, inner)
        elif self.dims:
            self._pipeline(buf, dt, inner)
        if op is ReduceOp.AVERAGE and self.world > 1:
            reduce_into(buf, [buf], ReduceOp.AVERAGE, dt, self.world)
        self._wall += time.perf_counter() - t0
        self._calls += 1
        if self.dump_iter and self._calls % self.dump_iter == 0:
            self._dump(buf.nbytes)

    def _timed(self, k: int, fn: Callable, *args) -> None:
        t = time.perf_counter()
        fn(*args)
        t1 = time.perf_counter()
        self._busy[k] += t1 - t
        if _tl.recorder is not None:  # args[0]: the part of the buffer this phase moved
            _tl.phase(f"dim{self.dims[k].index} {fn.__name__}", "phase", t, t1,
                      {"bytes": int(args[0].nbytes)})

    def _pipeline(self, buf: np.ndarray, dt: DType, op: ReduceOp) -> None:
        k = len(self.dims)
        plan = chunk_plan(buf.size, self.dims, self.chunk_bytes // dt.itemsize)
        C = len(plan)
        # views[j][i]: the part of chunk i dimension j works on; counts[j][i]: its blocks
        views = [[buf[plan[i][j][0] : plan[i][j][1]] for i in range(C)] for j in range(k)]
        counts = [[plan[i][j][2] for i in range(C)] for j in range(k)]
        ready = [[threading.Event() for _ in range(C)] for _ in range(k)]  # reduce-scattered
        done = [[threading.Event() for _ in range(C)] for _ in range(k)]  # fully reduced again
        failure: list[BaseException] = []

        def wait(stage: threading.Event) -> None:
            deadline = time.monotonic() + self.timeout * 2 + 5
            while not stage.wait(0.05):
                if failure:
                    raise _Abandon()
                if time.monotonic() > deadline:
                    raise DDLTimeoutError(f"rank {self.rank}: multi-dimensional allreduce "
                                          "pipeline stalled")
            if failure:
                raise _Abandon()

        def run_dim(j: int) -> None:
            d = self.dims[j]
            last = j == k - 1
            try:
                for i in range(C):
                    if j:
                        wait(ready[j - 1][i])
                    if last:
                        self._timed(j, d.allreduce, views[j][i], dt, op)
                        done[j][i].set()
                        continue
                    self._timed(j, d.reduce_scatter, views[j][i], counts[j][i], dt, op)
                    ready[j][i].set()
                    if i:
                        wait(done[j + 1][i - 1])
                        self._timed(j, d.allgather, views[j][i - 1], counts[j][i - 1], dt)
                        done[j][i - 1].set()
                if not last:
                    wait(done[j + 1][C - 1])
                    self._timed(j, d.allgather, views[j][C - 1], counts[j][C - 1], dt)
                    done[j][C - 1].set()
            except _Abandon:
                pass
            except BaseException as exc:  # handed to the caller below
                failure.append(exc)

        threads = [threading.Thread(target=run_dim, args=(j,), name=f"ddl-dim{j}", daemon=True)
                   for j in range(1, k)]
        for t in threads:
            t.start()
        run_dim(0)
        for t in threads:
            t.join()
        if failure:
            raise failure[0]

    def _dump(self, nbytes: int) -> None:
        if self.rank != 0:
            return
        n = self.dump_iter
        parts = ", ".join(f"{d.describe(nbytes)} {1e3 * self._busy[j] / n:.2f} ms"
                          for j, d in enumerate(self.dims))
        _log.info("[ddl] allreduce #%d (%d B): %s; wall %.2f ms per call", self._calls, nbytes,
                  parts, 1e3 * self._wall / n)
        self._busy = [0.0] * len(self.dims)
        self._wall = 0.0

    def close(self) -> None:
        for d in self.dims:
            d.close()


class _Abandon(Exception):
    """Another dimension failed: stop quietly, its error is the one reported."""

    ddl_internal = True  # passed between ddl's layers: never shown to a user (failures)
