"""The memory-bandwidth roofline in ddl-perf's reports.

A host collective cannot finish faster than its host's memory can move the bytes it must
touch. ``ddl-perf`` measures that memory bandwidth once per host, STREAM-style, with every
rank of the host running the kernels at the same time (the ranks of a job share the
memory), caches it, and reports beside each measurement the fraction of that bound it
reached: ``bound time / measured time`` (1.0 = at the memory limit).

The bound (docs/perf-tools.md says why): every rank on a host reads its input and writes
its output at least once, whatever the algorithm, except what a placement leaves where it
is; S the row's size in bytes, n the ranks, p the ranks of a host:

- allreduce: 2pS (in place too: the input is read and the result written over it);
- reduce_scatter (S the input): p(S + S/n);
- allgather (S the output): p(S/n + S) out of place; in place, where each rank's own block
  is already in its output, pS;
- alltoall: 2pS out of place; in place 2pS(n-1)/n (each rank's own block stays);
- broadcast: pS written plus the root's S read; in place the root writes nothing: pS.

The job's bound is its slowest host's: the largest p / B over its hosts. An in-place
allreduce on one rank moves nothing: no bound.

``bound = bytes / B``, B the host's bandwidth: the higher of STREAM copy and STREAM add
(bytes counted as STREAM counts them: 2 per copied byte, 3 per added one), every rank of
the host's bytes over the host's span from the first start to the last end (one clock for
the host's processes), on arrays four times the last-level cache shared out over the
host's ranks, best of 5.
Sizes that fit in the caches can beat the memory bound: their fraction may pass 1.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

REPS = 5
MIN_ARRAY, MAX_ARRAY = 32 << 20, 512 << 20
MODES = ("auto", "fresh", "off")


@dataclass(frozen=True)
class Bandwidth:
    """One host's memory bandwidth with ``ranks_per_host`` ranks streaming at once
    (GB/s, 10^9 bytes, STREAM's byte counts), the slowest host of the job."""

    copy: float
    add: float
    ranks_per_host: int
    array_bytes: int
    host: str
    cached: bool

    @property
    def peak(self) -> float:
        """B of the bound: the higher of copy and add."""
        return max(self.copy, self.add)

    def describe(self) -> str:
        how = "cached" if self.cached else "measured now"
        return (f"# memory roofline: {self.peak:.1f} GB/s per host (STREAM copy {self.copy:.1f}, "
                f"add {self.add:.1f}; {self.ranks_per_host} rank(s) streaming at once on "
                f"{self.host}, {self.array_bytes >> 20} MiB arrays, {how}); roof% = bound "
                "time / measured time (docs/perf-tools.md)")

    def as_json(self) -> dict:
        return {"copy_gbs": self.copy, "add_gbs": self.add, "bound_gbs": self.peak,
                "ranks_per_host": self.ranks_per_host, "array_bytes": self.array_bytes,
                "host": self.host, "cached": self.cached}


def traffic_bytes(collective: str, size: int, ranks: int, per_host: int,
                  in_place: bool = False) -> float:
    """The fewest bytes a host with ``per_host`` of the job's ``ranks`` moves through its
    memory for one call (module docstring)."""
    n, p, s = max(1, ranks), max(1, per_host), float(size)
    if collective == "allreduce":
        return 0.0 if in_place and n == 1 else 2 * p * s
    if collective == "alltoall":
        return 2 * p * s * (n - 1) / n if in_place else 2 * p * s
    if collective == "reduce_scatter":
        return p * (s + s / n)
    if collective == "allgather":
        return p * s if in_place else p * (s + s / n)
    if collective == "broadcast":
        return p * s if in_place else p * s + s
    raise ValueError(f"no roofline for {collective!r}")


def bound_seconds(bw: Bandwidth, collective: str, size: int, ranks: int,
                  in_place: bool = False) -> float:
    return traffic_bytes(collective, size, ranks, bw.ranks_per_host, in_place) / (bw.peak * 1e9)


def fraction(bw: Bandwidth | None, collective: str, size: int, ranks: int,
             seconds: float, in_place: bool = False) -> float | None:
    """bound / measured (None without a roofline, a time or a bound)."""
    if bw is None or seconds <= 0 or bw.peak <= 0:
        return None
    bound = bound_seconds(bw, collective, size, ranks, in_place)
    return bound / seconds if bound > 0 else None


# ----------------------------------------------------------------------- measuring
def llc_bytes() -> int:
    """The largest CPU cache of this host (sysfs), 32 MiB when it cannot be read."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = [e for e in os.listdir(base) if e.startswith("index")]
    except OSError:
        entries = []
    for entry in entries:  # (the folder also holds uevent, power: not caches)
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * unit)
        except (OSError, ValueError):
            continue
    return best or 32 << 20


def array_bytes(per_host: int) -> int:
    """STREAM's rule: the arrays of all ranks together are 4x the last-level cache."""
    return int(min(MAX_ARRAY, max(MIN_ARRAY, 4 * llc_bytes() // max(1, per_host))))


def stream_spans(nbytes: int, barrier: Any, reps: int = REPS
                 ) -> list[tuple[float, float]]:
    """``reps`` of ``c = a`` then ``reps`` of ``c = a + b`` on float64 arrays of ``nbytes``,
    each after ``barrier()`` so that the host's ranks stream together: (start, end) of each
    on ``time.monotonic`` (one clock for every process of a host, so the host's span of a
    repetition is its earliest start to its latest end even when ranks outnumber cores)."""
    n = nbytes // 8
    a, b, c = np.ones(n), np.full(n, 2.0), np.zeros(n)  # written: the pages exist
    spans = []
    for kernel in (lambda: np.copyto(c, a), lambda: np.add(a, b, c)):
        for _ in range(reps):
            barrier()
            t0 = time.monotonic()
            kernel()
            spans.append((t0, time.monotonic()))
    return spans


def host_rates(spans_of_ranks: list[list[tuple[float, float]]], nbytes: int,
               reps: int = REPS) -> tuple[float, float]:
    """(copy, add) GB/s of one host from its ranks' ``stream_spans``: per repetition every
    rank's bytes over the host's span, the best repetition (STREAM's byte counts)."""
    p = len(spans_of_ranks)
    rates = []
    for kernel, words in ((0, 2), (1, 3)):
        best = 0.0
        for r in range(reps):
            k = kernel * reps + r
            span = max(s[k][1] for s in spans_of_ranks) - min(s[k][0] for s in spans_of_ranks)
            best = max(best, p * words * nbytes / max(span, 1e-9) / 1e9)
        rates.append(best)
    return rates[0], rates[1]


def cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "ddl", "stream.json")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(host: str, per_host: int) -> str:
    return f"{host}|{_cpu_model()}|{os.cpu_count()} cpus|{per_host} ranks"


def _read_cache() -> dict:
    try:
        with open(cache_path()) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, entry: dict) -> None:
    path = cache_path()
    doc = _read_cache()
    doc[key] = entry
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{platform.node()}.{os.getpid()}"  # a home shared by hosts
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time


def host_id() -> str:
    """This host as the roofline groups ranks: its name and its kernel's boot id (two
    machines with one name, cloned VMs or ``localhost``, are two hosts, each with its own
    monotonic clock)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = ""
    name = "".join(platform.node().split()) or "host"  # one word: the lines are split
    return f"{name}#{boot}" if boot else name


def _figure(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and x > 0)


def host_bandwidth(harness: Any, mode: str = "auto") -> Bandwidth | None:
    """The job's roofline, the same on every rank (collective: every rank calls it).
    ``auto``: from each host's cache when every host has one, else measured (and cached);
    ``fresh``: measured; ``off``: None."""
    if mode == "off":
        return None
    host = host_id()
    hosts = harness.gather_lines(host)
    per_host = hosts.count(host)
    key = cache_key(platform.node(), per_host)
    entry = _read_cache().get(key) if mode == "auto" else None
    ok = isinstance(entry, dict) and all(_figure(entry.get(k))
                                         for k in ("copy", "add", "array_bytes"))
    # every rank measures when any host lacks its figure: the kernels' barriers are the job's
    measured = harness.total(0 if ok else 1) > 0
    if measured:
        size = array_bytes(per_host)
        mine = stream_spans(size, harness.barrier)
        # 2 x REPS spans of two "%.6f" monotonic times: ~320 of gather_lines' 512 bytes
        lines = harness.gather_lines(" ".join(f"{t:.6f}" for span in mine for t in span))
        spans = [[(float(v[i]), float(v[i + 1])) for i in range(0, len(v), 2)]
                 for h, line in zip(hosts, lines, strict=True) if h == host
                 for v in [line.split()]]
        copy, add = host_rates(spans, size)
        entry = {"copy": copy, "add": add, "array_bytes": size,
                 "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if hosts.index(host) == harness.rank:  # one writer per host
            _write_cache(key, entry)
    figures = harness.gather_lines(
        f"{float(entry['copy'])!r} {float(entry['add'])!r} {int(entry['array_bytes'])}")
    by_host = {h: tuple(float(x) for x in line.split())
               for h, line in zip(hosts, figures, strict=True)}
    # the job's bound is its slowest host's: the most ranks per unit of bandwidth
    slowest = max(by_host, key=lambda h: (hosts.count(h) / max(by_host[h][:2]), h))
    copy, add, size = by_host[slowest]
    return Bandwidth(copy, add, hosts.count(slowest), int(size), slowest, not measured)
