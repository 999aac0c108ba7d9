"""The harness of ``ddl-perf allreduce | allgather | broadcast | reduce_scatter | alltoall``:
nccl-tests-compatible collective benchmarks (see docs/performance.md).

In the manner of nccl-tests: one small plugin per collective (``COLLECTIVES``: how a byte
size becomes element counts, the bus-bandwidth factor), a size sweep, warm-up, out-of-place
and in-place timed apart, correctness checked outside the timed region against exactly
representable expected values, a ``#``-prefixed table in nccl-tests' columns and widths and
a JSON twin of it. The pure parts shared with the engines (counts, bandwidth, element types,
data patterns: ``collectives.py``) and the sizes (``sizes.py``) live below this module and
are re-exported here; formatting comes first, then ``run_job``, the loop every rank of a
job runs over the engines of ``worker.py``.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from .collectives import (  # noqa: F401  (re-exported: ``ar.Counts`` and co)
    COLLECTIVES,
    DTYPES,
    OPS,
    Collective,
    Counts,
    ElementType,
    busbw,
    count_wrong,
    device_line,
    expected,
    host_description,
    itemsize,
    parse_dtype,
    rank_input,
)
from .roofline import Bandwidth, bound_seconds, fraction, host_bandwidth
from .sizes import parse_size, sweep  # noqa: F401  (re-exported)
from .worker import Null


# ------------------------------------------------------------------------ formatting
@dataclass(frozen=True)
class Timing:
    """One measurement: seconds per call (averaged over ranks), algbw and busbw in GB/s,
    and wrong elements summed over ranks (None: not checked, printed N/A)."""

    seconds: float
    algbw: float
    busbw: float
    wrong: int | None


def timing(size_bytes: int, seconds: float, nranks: int, collective: str,
           wrong: int | None) -> Timing:
    alg = size_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return Timing(seconds, alg, alg * COLLECTIVES[collective].bus_factor(nranks), wrong)


def _time_us(seconds: float) -> str:
    us = seconds * 1e6
    if us >= 10000:
        return f"{us:7.0f}"
    return f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


def _body(t: Timing) -> str:
    wrong = "N/A" if t.wrong is None else str(t.wrong)
    return f"  {_time_us(t.seconds)}  {t.algbw:6.2f}  {t.busbw:6.2f}  {wrong:>5}"


def format_row(size_bytes: int, count: int, type_name: str, op_name: str, root: int,
               out_of_place: Timing, in_place: Timing) -> str:
    """One line of the table, byte for byte as nccl-tests prints it."""
    return (f"{size_bytes:12d}  {count:12d}  {type_name:>8}  {op_name:>6}  {root:6d}"
            + _body(out_of_place) + _body(in_place))


_LEAD = f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}"


def table_header() -> list[str]:
    """nccl-tests' three column-header lines (trailing spaces included)."""
    return [
        _LEAD + "           out-of-place                       in-place          ",
        f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}"
        f"  {'time':>7}  {'algbw':>6}  {'busbw':>6} {'#wrong':>6}"
        f"  {'time':>7}  {'algbw':>6}  {'busbw':>6} {'#wrong':>6}",
        f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}"
        f"  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>5}"
        f"  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>5}",
    ]


def footer(wrong_measurements: int, avg_busbw: float) -> list[str]:
    return [f"# {'Out of bounds values':<20} : {wrong_measurements} "
            f"{'FAILED' if wrong_measurements else 'OK'}",
            f"# {'Avg bus bandwidth':<20} : {avg_busbw:g} ", "#"]


OURS = ("ddl", "ddl-heap", "ddl-torch")


def compare_header(engines: Sequence[str], roof: bool = False
                   ) -> tuple[list[str], list[tuple[str, str]]]:
    """The header of ``--compare``'s table and its ratio columns (ours, peer): one row per
    size and placement, each engine's time and busbw (and, with ``roof``, the fraction of
    the memory roofline it reached), #wrong summed over engines and ranks, then peer time
    / our time (> 1: ours is faster)."""
    ratios = [(a, b) for a in OURS if a in engines for b in engines if b not in OURS]
    cols = [f"{'size':>10}", f"{'count':>12}", f"{'type':>8}", f"{'redop':>6}",
            f"{'root':>6}", f"{'place':>5}"]
    for e in engines:
        cols += [f"{e + ' us':>{max(9, len(e) + 3)}}", f"{e + ' GB/s':>{max(9, len(e) + 5)}}"]
        if roof:
            cols.append(f"{e + ' roof%':>{len(e) + 6}}")
    cols.append(f"{'#wrong':>6}")
    cols += [f"{f'{b}/{a}':>{max(8, len(a) + len(b) + 1)}}" for a, b in ratios]
    note = "# (time in us, busbw in GB/s; ratios: peer time / ddl time, > 1: ddl faster"
    note += "; roof%: the memory roofline's bound time / time)" if roof else ")"
    return ["# " + "  ".join(cols), note], ratios


def _percent(frac: float | None) -> str:
    return "-" if frac is None else f"{100 * frac:.0f}"


def compare_row(size_bytes: int, count: int, type_name: str, op_name: str, root: int,
                place: str, engines: Sequence[str], by: dict[str, Timing],
                ratios: Sequence[tuple[str, str]],
                roof: dict[str, float | None] | None = None) -> str:
    cells = [f"{size_bytes:12d}", f"{count:12d}", f"{type_name:>8}", f"{op_name:>6}",
             f"{root:6d}", f"{place:>5}"]
    wrong: int | None = None
    for e in engines:
        t = by[e]
        cells += [f"{_time_us(t.seconds).strip():>{max(9, len(e) + 3)}}",
                  f"{t.busbw:>{max(9, len(e) + 5)}.2f}"]
        if roof is not None:
            cells.append(f"{_percent(roof.get(e)):>{len(e) + 6}}")
        if t.wrong is not None:
            wrong = (wrong or 0) + t.wrong
    cells.append(f"{'N/A' if wrong is None else wrong:>6}")
    for a, b in ratios:
        ta, tb = by[a].seconds, by[b].seconds
        cells.append(f"{f'{tb / ta:.2f}x' if ta > 0 else '-':>{max(8, len(a) + len(b) + 1)}}")
    return "  " + "  ".join(cells)


# ------------------------------------------------------------------- the job's loop
@dataclass(frozen=True)
class Config:
    collective: str
    sizes: tuple[int, ...]
    iters: int = 20
    warmup: int = 5
    check: int = 1
    dtype: ElementType = DTYPES["float"]
    op: str = "sum"
    root: int = 0
    device: str = "cpu"
    engines: tuple[str, ...] = ("ddl",)
    factor: int = 1
    step: int = 1 << 20
    json_path: str | None = None
    argv: tuple[str, ...] = ()
    # -b/-e as given: nccl-tests' header prints these, not the last size the sweep reached
    min_bytes: int | None = None
    max_bytes: int | None = None
    roofline: str = "off"  # roofline.MODES: the CLI's default is auto

    @property
    def bounds(self) -> tuple[int, int]:
        return (min(self.sizes) if self.min_bytes is None else self.min_bytes,
                max(self.sizes) if self.max_bytes is None else self.max_bytes)


@dataclass
class Record:
    """What rank 0 keeps for the footer and the JSON twin."""

    rows: list[dict] = field(default_factory=list)
    wrong_measurements: int = 0
    busbw: dict[str, list[float]] = field(default_factory=dict)
    overhead: float = 0.0  # seconds per timed call that the harness itself costs
    bandwidth: Bandwidth | None = None  # the memory roofline, when measured
    roof_lines: list[str] = field(default_factory=list)  # after nccl-tests' table


def _op_name(cfg: Config) -> str:
    return cfg.op if COLLECTIVES[cfg.collective].reduces else "none"


def _root(cfg: Config) -> int:
    return cfg.root if COLLECTIVES[cfg.collective].rooted else -1


def timed(run: Callable[[], None], iters: int, sync: Callable[[], None]) -> float:
    """Seconds per call of ``iters`` calls of ``run`` then one ``sync``: the one timed loop
    of every row, and of the harness's own overhead (``harness_overhead``)."""
    start = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    return (time.perf_counter() - start) / max(1, iters)


OVERHEAD_BYTES = 1024


def harness_overhead(null: Any, cfg: Config, nranks: int, iters: int = 2000,
                     reps: int = 5) -> float:
    """Seconds the harness adds to each timed call: the very loop of a row (``timed``, the
    prepared call's closure, the engine's method and its argument lookups) run on a
    collective that does nothing (``null``, worker.Null), at 1 KiB out of place; the
    fastest of ``reps`` runs, as the floor under every row's time."""
    coll = COLLECTIVES[cfg.collective]
    counts = coll.counts(max(1, OVERHEAD_BYTES // itemsize(cfg.dtype)), nranks)
    call = null.prepare(cfg.collective, counts, cfg.dtype, cfg.op, cfg.root, False)
    return min(timed(call.run, iters, null.sync) for _ in range(reps))


def _measure(engine: Any, harness: Any, cfg: Config, counts: Counts, in_place: bool,
             nranks: int, size_bytes: int) -> Timing:
    """Time ``cfg.iters`` calls after one untimed call (nccl-tests' BenchTime), average
    the per-call time over ranks, then check ``cfg.check`` times outside the timed part."""
    coll, rank = cfg.collective, harness.rank
    call = engine.prepare(coll, counts, cfg.dtype, cfg.op, cfg.root, in_place)
    call.load(rank_input(coll, counts, rank, nranks, cfg.op, cfg.dtype, seed=99))
    call.run()
    engine.sync()
    harness.barrier()
    with np.errstate(all="ignore"):  # in place, -n sums of sums overflow, as on a GPU
        seconds = timed(call.run, cfg.iters, engine.sync)
    seconds = harness.mean(seconds)
    wrong: int | None = 0 if cfg.check else None
    for rep in range(cfg.check):
        seed = rep + 1
        call.load(rank_input(coll, counts, rank, nranks, cfg.op, cfg.dtype, seed))
        call.run()
        engine.sync()
        mine = count_wrong(call.result(), expected(coll, counts, rank, nranks, cfg.op,
                                                   cfg.dtype, cfg.root, seed))
        wrong = harness.total(mine)
        if wrong:
            break
    return timing(size_bytes, seconds, nranks, coll, wrong)


def _warm_up(engines: Sequence[Any], cfg: Config, nranks: int) -> None:
    """nccl-tests warms up at the largest size, then at the smallest, out of place."""
    coll = cfg.collective
    for size in dict.fromkeys((max(cfg.sizes), min(cfg.sizes))):
        counts = COLLECTIVES[coll].counts(size // itemsize(cfg.dtype), nranks)
        for engine in engines:
            call = engine.prepare(coll, counts, cfg.dtype, cfg.op, cfg.root, False)
            for _ in range(cfg.warmup):
                call.run()
            engine.sync()


def header(cfg: Config, nranks: int, devices: Sequence[str], describe: str) -> list[str]:
    step = f"{cfg.factor}(factor)" if cfg.factor > 1 else f"{cfg.step}(bytes)"
    from .. import __version__

    return [
        f"# ddl-perf {cfg.collective} (ddl {__version__}; the columns of nccl-tests' "
        f"{COLLECTIVES[cfg.collective].nccl_name}) on {platform.node()} "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"# {describe}",
        f"# nRanks {nranks} minBytes {cfg.bounds[0]} maxBytes {cfg.bounds[1]} step: {step} "
        f"warmup iters: {cfg.warmup} iters: {cfg.iters} agg iters: 1 validation: {cfg.check} "
        f"graph: 0 device: {cfg.device}",
        "#", "# Using devices", *devices, "#",
    ]


def run_job(cfg: Config, engines: Sequence[Any], harness: Any,
            out: IO[str] | None = None) -> int:
    """The sweep on every rank of the job: rows printed by rank 0 as soon as measured;
    returns 1 on every rank when any element was wrong, else 0."""
    nranks, rank = harness.size, harness.rank
    names = [e.name for e in engines]
    compare = len(engines) > 1
    devices = harness.gather_lines(engines[0].device_line(rank))
    rec = Record(busbw={n: [] for n in names})
    ratios: list[tuple[str, str]] = []

    def emit(line: str) -> None:
        if rank == 0:
            print(line, file=out or sys.stdout, flush=True)

    for line in header(cfg, nranks, devices, engines[0].describe()):
        emit(line)
    # the memory roofline before the table: its kernels must not run between two rows
    bw = host_bandwidth(harness, cfg.roofline if cfg.device == "cpu" else "off")
    rec.bandwidth = bw
    if bw is not None:
        emit(bw.describe())
    if compare:
        lines, ratios = compare_header(names, roof=bw is not None)
        for line in lines:
            emit(line)
    else:
        for line in table_header():
            emit(line)
    _warm_up(engines, cfg, nranks)
    rec.overhead = harness.mean(harness_overhead(Null(rank, nranks, "cpu"), cfg, nranks))
    emit(f"# harness overhead per timed call: {rec.overhead * 1e6:.3f} us (the timed loop "
         f"on a no-op {cfg.collective}, {OVERHEAD_BYTES} B)")
    coll = COLLECTIVES[cfg.collective]
    for size in cfg.sizes:
        counts = coll.counts(size // itemsize(cfg.dtype), nranks)
        shown = max(counts.send, counts.recv) * itemsize(cfg.dtype)
        by: dict[bool, dict[str, Timing]] = {False: {}, True: {}}
        for in_place in (False, True):
            for engine in engines:  # interleaved: the peers share the machine's noise
                t = _measure(engine, harness, cfg, counts, in_place, nranks, shown)
                by[in_place][engine.name] = t
                rec.busbw[engine.name].append(t.busbw)
                rec.wrong_measurements += bool(t.wrong)
        lead = (shown, counts.param, cfg.dtype.name, _op_name(cfg), _root(cfg))
        roof = {p: {e: fraction(bw, cfg.collective, shown, nranks, t.seconds, p)
                    for e, t in by[p].items()} for p in (False, True)}
        if compare:
            for in_place in (False, True):
                emit(compare_row(*lead, "in" if in_place else "out", names, by[in_place],
                                 ratios, roof[in_place] if bw is not None else None))
        else:
            emit(format_row(*lead, by[False][names[0]], by[True][names[0]]))
            if bw is not None:
                rec.roof_lines.append(roof_row(
                    shown, bound_us(bw, cfg, shown, nranks, False), roof[False][names[0]],
                    bound_us(bw, cfg, shown, nranks, True), roof[True][names[0]]))
        for name in names:
            rec.rows.append(_json_row(cfg, name, nranks, lead, by[False][name],
                                      by[True][name], bw, roof[False][name],
                                      roof[True][name]))
    avg = {n: (sum(v) / len(v) if v else 0.0) for n, v in rec.busbw.items()}
    if rec.roof_lines:  # nccl-tests' rows keep their 13 columns: the roofline comes after
        for line in [*roof_header(), *rec.roof_lines]:
            emit(line)
    lines = footer(rec.wrong_measurements, avg[names[0]])
    if compare:
        lines[1:2] = [f"# {'Avg bus bandwidth':<20} : {avg[n]:g} ({n})" for n in names]
    for line in lines:
        emit(line)
    if rank == 0 and cfg.json_path:
        _write_json(cfg, nranks, devices, rec, avg)
    return 1 if rec.wrong_measurements else 0


def bound_us(bw: Bandwidth, cfg: Config, size: int, nranks: int, in_place: bool) -> float:
    return bound_seconds(bw, cfg.collective, size, nranks, in_place) * 1e6


def roof_header() -> list[str]:
    return ["# memory roofline per size: the bound's time and the fraction of it reached "
            "(bound / time), out of place and in place",
            f"# {'size':>10}  {'bound us':>9}  {'roof%':>5}  {'bound us':>9}  {'roof%':>5}"]


def roof_row(size: int, out_bound: float, out: float | None, in_bound: float,
             inp: float | None) -> str:
    return (f"# {size:10d}  {_time_us(out_bound * 1e-6).strip():>9}  {_percent(out):>5}  "
            f"{_time_us(in_bound * 1e-6).strip():>9}  {_percent(inp):>5}")


def _json_row(cfg: Config, engine: str, nranks: int, lead: tuple, oop: Timing,
              ip: Timing, bw: Bandwidth | None = None, roof_oop: float | None = None,
              roof_ip: float | None = None) -> dict:
    size, count, type_name, op_name, root = lead

    def part(t: Timing, roof: float | None, in_place: bool) -> dict:
        bound = None if bw is None else bound_us(bw, cfg, size, nranks, in_place)
        return {"time": t.seconds * 1e6, "alg_bw": t.algbw, "bus_bw": t.busbw,
                "nwrong": t.wrong, "roofline": roof, "roofline_bound_us": bound}

    return {"engine": engine, "ranks": nranks, "size": size, "count": count,
            "type": type_name, "redop": op_name, "root": root,
            "out_of_place": part(oop, roof_oop, False), "in_place": part(ip, roof_ip, True),
            "actual_iterations": cfg.iters, "experiment_name": cfg.collective}


def _write_json(cfg: Config, nranks: int, devices: Sequence[str], rec: Record,
                avg: dict[str, float]) -> None:
    """nccl-tests' JSON layout (version 2) with ddl-perf's additions (engine, ranks)."""
    doc = {
        "version": 2, "tool": "ddl-perf", "collective": cfg.collective,
        "end_time": time.strftime("%Y-%m-%d %H:%M:%S"), "args": list(cfg.argv),
        "config": {"nranks": nranks, "minimum_bytes": cfg.bounds[0],
                   "maximum_bytes": cfg.bounds[1],
                   **({"step_factor": cfg.factor} if cfg.factor > 1
                      else {"step_bytes": cfg.step}),
                   "warmup_iters": cfg.warmup, "iterations": cfg.iters,
                   "validation": cfg.check, "datatype": cfg.dtype.name, "op": _op_name(cfg),
                   "root": _root(cfg), "device": cfg.device, "engines": list(cfg.engines)},
        "devices": [d.removeprefix("#  ") for d in devices],
        "results": rec.rows,
        "harness_overhead_us": rec.overhead * 1e6,
        "memory_bandwidth": None if rec.bandwidth is None else rec.bandwidth.as_json(),
        "out_of_bounds": {"count": rec.wrong_measurements,
                          "okay": rec.wrong_measurements == 0},
        "average_bus_bandwidth": {"bandwidth": avg[cfg.engines[0]], "okay": "unchecked",
                                  "by_engine": avg},
    }
    with open(cfg.json_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
