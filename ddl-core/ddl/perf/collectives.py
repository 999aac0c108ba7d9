"""The pure parts of the collective benchmarks, what the harness (``allreduce.py``) and the
engines (``worker.py``) share: each collective's element counts and bus-bandwidth factor
(``COLLECTIVES``), the element types, the data patterns whose results are exact in every
type, the count of wrong elements, and the device lines of the report's header.
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import dtypes


# ------------------------------------------------------------------- the collectives
@dataclass(frozen=True)
class Counts:
    """Elements of one rank's send and receive buffers, and the count the collective is
    called with (nccl-tests' sendcount, recvcount, paramcount)."""

    send: int
    recv: int
    param: int


@dataclass(frozen=True)
class Collective:
    name: str
    nccl_name: str  # the nccl-tests binary that measures the same thing
    reduces: bool  # takes a reduction op (-o)
    rooted: bool  # takes a root (-r)
    counts: Callable[[int, int], Counts]  # (elements in the size, ranks) -> Counts
    bus_factor: Callable[[int], float]  # ranks -> busbw / algbw


def _ring(n: int) -> float:
    return (n - 1) / n


COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective("allreduce", "all_reduce_perf", True, False,
               lambda c, n: Counts(c, c, c), lambda n: 2 * (n - 1) / n),
    Collective("allgather", "all_gather_perf", False, False,
               lambda c, n: Counts(c // n, c // n * n, c // n), _ring),
    Collective("broadcast", "broadcast_perf", False, True,
               lambda c, n: Counts(c, c, c), lambda n: 1.0),
    Collective("reduce_scatter", "reduce_scatter_perf", True, False,
               lambda c, n: Counts(c // n * n, c // n, c // n), _ring),
    Collective("alltoall", "alltoall_perf", False, False,
               lambda c, n: Counts(c // n * n, c // n * n, c // n), _ring),
)}


def busbw(nbytes: int, seconds: float, ranks: int, collective: str = "allreduce") -> float:
    """Bus bandwidth in GB/s, as nccl-tests counts it: algbw (bytes / time) times the
    collective's factor: allreduce 2(n-1)/n, allgather, reduce_scatter and alltoall
    (n-1)/n, broadcast 1. ``nbytes`` is the size column (for allgather and reduce_scatter
    the total over ranks). 0 for an allreduce of one rank (nothing crosses a bus)."""
    return nbytes / seconds * COLLECTIVES[collective].bus_factor(ranks) / 1e9


# --------------------------------------------------------------------- element types
@dataclass(frozen=True)
class ElementType:
    """One of nccl-tests' element types (``-d``): its name there, over ddl's own DType
    (``ddl.dtypes``), which knows the storage, the width and whether it is a float."""

    name: str  # as nccl-tests prints it
    dtype: dtypes.DType

    @property
    def numpy(self) -> str:
        """numpy's name of the type; "" for bfloat16, which numpy has not (torch only)."""
        return "" if self.dtype is dtypes.BFLOAT16 else self.dtype.storage.name

    @property
    def torch(self) -> str:
        return self.dtype.name

    @property
    def is_float(self) -> bool:
        return self.dtype.is_float


DTYPES: dict[str, ElementType] = {name: ElementType(name, dtypes.BY_NAME[core]) for name, core in (
    ("int8", "int8"), ("uint8", "uint8"), ("int32", "int32"), ("uint32", "uint32"),
    ("int64", "int64"), ("uint64", "uint64"), ("half", "float16"), ("float", "float32"),
    ("double", "float64"), ("bfloat16", "bfloat16"),
)}
_DTYPE_ALIASES = {"char": "int8", "int": "int32", "float16": "half", "fp16": "half",
                  "float32": "float", "fp32": "float", "float64": "double", "bf16": "bfloat16"}
OPS = ("sum", "prod", "max", "min", "avg")


def parse_dtype(text: str) -> ElementType:
    name = _DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPES:
        raise ValueError(f"unknown data type {text!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def itemsize(dtype: ElementType) -> int:
    return dtype.dtype.itemsize


# ---------------------------------------------------------------------- data patterns
# Every rank's input is small integers chosen so that the result of each op is exactly
# representable in every type (half: sums up to 2048; bfloat16: up to 256), whatever order
# an engine reduces in: integer types wrap modulo 2^k, the same in any order; products of
# 1s and 2s are powers of two (or overflow to inf in every order); for avg the ranks'
# offsets cancel, so the sum is n times a small integer and the average is that integer.
def _values(index: np.ndarray, rank: int, nranks: int, op: str) -> np.ndarray:
    """int64 input values of ``rank`` at the logical element positions ``index``."""
    if op == "prod":
        return (index + rank) % 2 + 1
    if op == "avg":
        pair = 0 if nranks % 2 and rank == nranks - 1 else (rank // 2) % 3 + 1
        return index % 11 + 4 + (pair if rank % 2 == 0 else -pair)
    return (index + 3 * rank) % 11 + 1


def _cast(values: np.ndarray, dtype: ElementType) -> np.ndarray:
    """int64 values in ``dtype``: wrapping for integers, exact (or inf) for floats; float32
    stands in for bfloat16, whose engines are handed the bfloat16 of it (exact)."""
    with np.errstate(over="ignore"):
        return values.astype(dtype.numpy or "float32")


def _reduce(stack: np.ndarray, op: str, nranks: int) -> np.ndarray:
    if op in ("sum", "avg"):
        total = stack.sum(axis=0)
        return total // nranks if op == "avg" else total
    if op == "prod":
        return np.prod(stack, axis=0)
    return stack.max(axis=0) if op == "max" else stack.min(axis=0)


def rank_input(collective: str, counts: Counts, rank: int, nranks: int, op: str,
               dtype: ElementType, seed: int = 0) -> np.ndarray:
    """What ``rank`` sends (``counts.send`` elements). ``seed`` shifts the pattern, so
    that each check (``-c``) moves different data."""
    index = np.arange(counts.send, dtype=np.int64) + seed
    if collective == "allgather":
        index = index + rank * counts.send
    return _cast(_values(index, rank, nranks, op), dtype)


def expected(collective: str, counts: Counts, rank: int, nranks: int, op: str,
             dtype: ElementType, root: int = 0, seed: int = 0) -> np.ndarray:
    """Exactly what ``rank`` must hold afterwards (``counts.recv`` elements)."""
    if collective == "broadcast":
        return rank_input(collective, counts, root, nranks, op, dtype, seed)
    if collective == "allgather":
        return np.concatenate([rank_input(collective, counts, j, nranks, op, dtype, seed)
                               for j in range(nranks)])
    if collective == "alltoall":
        block = counts.param
        return np.concatenate([
            rank_input(collective, counts, j, nranks, op, dtype, seed)[
                rank * block:(rank + 1) * block]
            for j in range(nranks)])
    index = np.arange(counts.send, dtype=np.int64) + seed
    result = _reduce(np.stack([_values(index, j, nranks, op) for j in range(nranks)]), op,
                     nranks)
    if collective == "reduce_scatter":
        result = result[rank * counts.recv:(rank + 1) * counts.recv]
    return _cast(result, dtype)


def count_wrong(got: np.ndarray, want: np.ndarray) -> int:
    """Elements of ``got`` that differ from ``want`` (nccl-tests' #wrong on one rank); a
    result of the wrong length counts every element of the longer one."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.shape != want.shape:
        return max(got.size, want.size)
    return int(np.count_nonzero(got != want))


def device_line(rank: int, pid: int, host: str, device: int, bus: str, name: str) -> str:
    return f"#  Rank {rank:2d} Group {0:2d} Pid {pid:6d} on {host:>10} device {device:2d} " \
           f"[{bus}] {name}"


def host_description() -> tuple[str, str]:
    """(host name, CPU description) for the device lines of a CPU run."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return socket.gethostname(), f"{name} ({os.cpu_count()} cores)"
