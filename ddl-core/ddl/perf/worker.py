"""One rank of an ``ddl-perf allreduce`` run: ``python -m ddl.perf.worker --engine E``.

Each engine is a small plugin (setup, allreduce in place, broadcast of a scalar, finish),
in the manner of nccl-tests. Timing: warm up, pick an iteration count on rank 0 that fills
``--target-seconds`` per repetition, broadcast it, then time ``--reps`` repetitions; the
median is reported. Correctness is checked after timing, outside the timed region, and a
wrong value makes the worker exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


class Plugin:
    name = "?"

    def setup(self) -> None: ...

    def buffer(self, count: int) -> np.ndarray:
        return np.empty(count, np.float32)

    def allreduce(self, buf: np.ndarray) -> None: ...

    def bcast_int(self, value: int) -> int: ...

    def barrier(self) -> None: ...

    def finish(self) -> None: ...


class DDL(Plugin):
    name = "ddl"

    def setup(self):
        import ddl

        self.ddl = ddl
        ddl.init()
        self.rank, self.size = ddl.rank(), ddl.size()

    def allreduce(self, buf):
        self.ddl.allreduce_(buf, op=self.ddl.Sum)

    def bcast_int(self, value):
        return int(self.ddl.broadcast(np.array([value], np.int64), 0)[0])

    def barrier(self):
        self.ddl.barrier()

    def finish(self):
        self.ddl.shutdown()


class DDLHeap(DDL):
    """Buffers from ddl.malloc: the data already lives in shared memory."""

    name = "ddl-heap"

    def buffer(self, count):
        return self.ddl.malloc((count,), np.float32)


class Gloo(Plugin):
    name = "gloo"

    def setup(self):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo", init_method="env://")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def buffer(self, count):
        self._t = self.torch.empty(count, dtype=self.torch.float32)
        return self._t.numpy()

    def allreduce(self, buf):
        self.dist.all_reduce(self._t)

    def bcast_int(self, value):
        t = self.torch.tensor([value], dtype=self.torch.int64)
        self.dist.broadcast(t, 0)
        return int(t[0])

    def barrier(self):
        self.dist.barrier()

    def finish(self):
        self.dist.destroy_process_group()


class MPI(Plugin):
    name = "mpi"

    def setup(self):
        from mpi4py import MPI as M

        self.M = M
        self.comm = M.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def allreduce(self, buf):
        self.comm.Allreduce(self.M.IN_PLACE, buf, op=self.M.SUM)

    def bcast_int(self, value):
        return int(self.comm.bcast(value, root=0))

    def barrier(self):
        self.comm.Barrier()


PLUGINS = {p.name: p for p in (DDL, DDLHeap, Gloo, MPI)}


def _fill(buf: np.ndarray, rank: int) -> None:
    buf[:] = (np.arange(buf.size, dtype=np.int64) % 7 + rank).astype(np.float32)


def _expected(count: int, size: int) -> np.ndarray:
    base = (np.arange(count, dtype=np.int64) % 7).astype(np.float32)
    return base * size + np.float32(size * (size - 1) // 2)


def run(engine: str, sizes: list[int], reps: int, target: float, out) -> int:
    plug = PLUGINS[engine]()
    plug.setup()
    bad = 0
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        buf = plug.buffer(count)
        _fill(buf, plug.rank)
        for _ in range(3):
            plug.allreduce(buf)
        plug.barrier()
        t = time.perf_counter()
        plug.allreduce(buf)
        one = max(time.perf_counter() - t, 1e-7)
        iters = plug.bcast_int(int(min(20000, max(2, target / one))))
        times = []
        for _ in range(reps):
            plug.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                plug.allreduce(buf)
            times.append((time.perf_counter() - t) / iters)
        _fill(buf, plug.rank)
        plug.allreduce(buf)
        ok = bool(np.array_equal(buf, _expected(count, plug.size)))
        bad += not ok
        if plug.rank == 0:
            rec = {"engine": engine, "ranks": plug.size, "bytes": count * 4, "iters": iters,
                   "times": times, "median": float(np.median(times)), "correct": ok}
            print(json.dumps(rec), file=out, flush=True)
        del buf
    plug.finish()
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddl.perf.worker")
    p.add_argument("--engine", choices=sorted(PLUGINS), required=True)
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--target-seconds", type=float, default=0.2)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run(a.engine, sizes, a.reps, a.target_seconds, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
