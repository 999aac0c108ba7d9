"""``ddl-perf calibrate``: measure each grid dimension's latency (alpha) and inverse
bandwidth (beta) on this cluster and write them as a cost profile (``DDL_COST_PROFILE``).

Run it inside a job, like the collective benchmarks::

    ddlrun -n 4 ddl-perf calibrate -o profile.json             # one host: shared memory
    ddlrun -H a:2,b:2 ddl-perf calibrate -o profile.json       # dim 0 shm, dim 1 network

The job's grid is ranks per host x hosts (or ``--grid``). Every rank runs the same
dimension's allreduce at the same time, so each line of a dimension shares its links with
the other lines exactly as in the multi-dimensional allreduce; dimensions are timed one
after the other, calls back to back within a repetition (``measure``). Each dimension runs what the
multi-dimensional allreduce runs on it: the outermost an allreduce, an inner one a
reduce-scatter then an allgather; across hosts on the engine's native collective (mode
``n``), inside a host on the shared-memory engine.

The fit (``fit_link``, pure) is the cost model's own formula for the algorithm that was
timed, ``T(s) = steps * alpha + wire(s) * beta + reduced(s) * gamma`` (ddl/cost.py), with
gamma measured first (``reduce_gamma``: seconds per byte of one rank's ``np.add`` while
every rank of the host adds at once, the slowest rank's): for a fixed dimension size
``steps``, ``wire`` and ``reduced`` are constants times ``s``, so it is a straight line
``a + b s``, fitted by least squares on the relative error (each point weighted by 1/T, so
4 KiB counts as much as 16 MiB), with alpha and beta constrained to be >= 0. The
shared-memory engine's cost changes at known sizes (one step up to its small size, its
data leaving the last-level cache, cross-memory reads where enabled); each range between
them that was measured gets its own line (``Link.regimes``), and the line over all sizes
prices any other.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from .. import api, config, cost
from ..engines.cma import MIN_BYTES as CMA_MIN_BYTES
from ..engines.identity_round import FOLD_BYTES
from ..engines.multihost import DimsEngine
from ..engines.shm import ShmEngine
from .roofline import llc_bytes
from .sizes import size_label, size_list

DEFAULT_SIZES = "1K,16K,64K,256K,1M,4M,16M,64M"
RIDE_BYTES = 1024  # a whole call of this size rides on the identity round (Profile.round_s)


# --------------------------------------------------------------------------- fitting (pure)
def model_factors(alg: str, n: int, gamma: float) -> tuple[float, float, float]:
    """(steps, wire bytes per byte, seconds of reduction per byte) of ``alg`` on ``n``
    ranks, read off the cost model itself so the fit and the prediction cannot differ."""
    probe = 1 << 20
    steps = cost.allreduce_time(alg, n, 0, cost.Link(alpha=1.0, beta=0.0, gamma=0.0))
    wire = cost.allreduce_time(alg, n, probe, cost.Link(alpha=0.0, beta=1.0, gamma=0.0)) / probe
    red = cost.allreduce_time(alg, n, probe, cost.Link(alpha=0.0, beta=0.0, gamma=gamma))
    return steps, wire, red / probe


def fit_link(alg: str, n: int, sizes: Sequence[float], seconds: Sequence[float],
             gamma: float = cost.Link(0, 0).gamma, bounds: Sequence[int] = ()) -> cost.Link:
    """alpha and beta of the Link that makes ``cost.allreduce_time(alg, n, s, link)`` closest
    to the measured ``seconds`` (module docstring: weighted least squares, both >= 0).
    ``bounds``: sizes where the engine changes path (``Target.bounds``); each path between
    two of them that was measured gets its own alpha and beta (``Link.regimes``): fitted
    from its sizes when it has two or more (and where its cost grows more slowly than
    ``gamma`` alone, the data staying in the caches, a gamma of its own with beta 0),
    through its one size with the whole fit's alpha when it has one; a path with none is
    priced by the whole fit."""
    whole = _fit_line(alg, n, sizes, seconds, gamma)
    inner = sorted({float(b) for b in bounds if b > 0})
    if not inner:
        return whole
    edges = [0.0, *inner, math.inf]
    regimes = []
    for lo, hi in zip(edges, edges[1:]):
        pts = [(s, t) for s, t in zip(sizes, seconds, strict=True) if lo <= s < hi]
        if not pts:
            continue
        if len({s for s, _ in pts}) >= 2:
            link = _fit_line(alg, n, [s for s, _ in pts], [t for _, t in pts], gamma,
                             own_gamma=True)
        else:
            link = _through(alg, n, pts[0][0], float(np.median([t for _, t in pts])), whole)
        regimes.append((lo, hi, link.alpha, link.beta, link.gamma))
    return dataclasses.replace(whole, regimes=tuple(regimes))


def _through(alg: str, n: int, size: float, seconds: float, whole: cost.Link) -> cost.Link:
    """The line through one measured size: the whole fit's alpha and the beta that meets
    the point; where the whole fit's reduction alone would take longer than the point (the
    caches reduce faster), beta 0 and the gamma that meets it; where even the start is
    longer, all alpha."""
    steps, wire, red = model_factors(alg, n, whole.gamma)
    if size <= 0:
        return cost.Link(seconds / steps, 0.0, whole.gamma)
    left = seconds - red * size - steps * whole.alpha
    if left >= 0:
        return cost.Link(whole.alpha, left / (wire * size), whole.gamma)
    reduced = red / whole.gamma if whole.gamma else 0.0  # bytes reduced per byte
    after_start = seconds - steps * whole.alpha
    if reduced and after_start > 0:
        return cost.Link(whole.alpha, 0.0, after_start / (reduced * size))
    return cost.Link(seconds / steps, 0.0, 0.0 if reduced else whole.gamma)


def _fit_line(alg: str, n: int, sizes: Sequence[float], seconds: Sequence[float],
              gamma: float, own_gamma: bool = False) -> cost.Link:
    """One line over every size (``fit_link`` without bounds). ``own_gamma``: when the
    times grow more slowly than ``gamma`` alone would have them, the slope is all
    reduction (beta 0, gamma from it) instead of all latency."""
    if n < 2:
        raise ValueError("a dimension of one rank moves nothing: nothing to fit")
    if len(sizes) != len(seconds) or len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError("need times at two or more different sizes")
    steps, wire, red = model_factors(alg, n, gamma)
    s = np.asarray(sizes, np.float64)
    t = np.asarray(seconds, np.float64)
    if np.any(t <= 0):
        raise ValueError("times must be positive")
    y = t - red * s  # what is left for alpha and beta
    w2 = 1.0 / t**2
    a, b = _line(s, y, w2)
    if b < 0 and own_gamma and red > 0:
        a0, slope = _line(s, t, w2)
        if slope >= 0 and a0 >= 0:  # faster reduction than measured from memory
            return cost.Link(alpha=a0 / steps, beta=0.0, gamma=slope / (red / gamma))
    if b < 0:  # all latency: no measurable size dependence
        a, b = float(np.sum(w2 * y) / np.sum(w2)), 0.0
    if a < 0:  # through the origin
        a, b = 0.0, float(np.sum(w2 * y * s) / np.sum(w2 * s * s))
    return cost.Link(alpha=max(a, 0.0) / steps, beta=max(b, 0.0) / wire, gamma=gamma)


def _line(x: np.ndarray, y: np.ndarray, w2: np.ndarray) -> tuple[float, float]:
    """Weighted least squares y ~ a + b x (the 2x2 normal equations)."""
    sw, sx, sy = w2.sum(), (w2 * x).sum(), (w2 * y).sum()
    sxx, sxy = (w2 * x * x).sum(), (w2 * x * y).sum()
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det
    return float((sy - b * sx) / sw), float(b)


def fit_profile(rows: list[dict], machine: str,
                gamma: float = cost.Link(0, 0).gamma,
                bounds: dict[int, Sequence[int]] | None = None) -> cost.Profile:
    """One DimProfile per dimension and engine from the measured rows
    ({"dim", "engine", "size", "algorithm", "bytes", "seconds"}), with ``gamma`` the
    seconds per byte reduced (``reduce_gamma``; default: the model's) and ``bounds`` each
    dimension's path changes (``Target.bounds``; default: none, one line)."""
    dims = []
    # per dimension and engine, in the order measured: the job's engine first (Profile.job_dims)
    for index, engine in dict.fromkeys((r["dim"], r["engine"]) for r in rows):
        mine = [r for r in rows if r["dim"] == index and r["engine"] == engine]
        first = mine[0]
        link = fit_link(first["algorithm"], first["size"], [r["bytes"] for r in mine],
                        [r["seconds"] for r in mine], gamma, (bounds or {}).get(index, ()))
        dims.append(cost.DimProfile(index, first["engine"], first["size"], first["algorithm"],
                                    link))
    return cost.Profile(machine, tuple(dims), tuple(rows))


# --------------------------------------------------------------------------- measuring
@dataclasses.dataclass(frozen=True)
class Target:
    """One grid dimension as calibrate times it: ``run(buf)`` allreduces along it."""
    index: int
    engine: str
    size: int
    algorithm: str
    run: Callable[[np.ndarray], None]
    # message sizes where the engine takes another path (fit_link's regimes)
    bounds: tuple[int, ...] = ()


def targets(engine) -> list[Target]:
    """The dimensions of the job's engine (ddl.api.job_engine()), innermost first."""
    from ..algorithms.dims import GroupDim, ShmDim
    from ..dtypes import BY_NAME

    f32 = BY_NAME["float32"]  # what ddl-perf and most gradients move
    if not isinstance(engine, DimsEngine):
        if engine.size < 2:
            return []
        # one host: the shared-memory engine is the whole job, dimension 0, timed as the
        # API's call (its own cost is part of every call here, and grows with the size
        # as its bookkeeping shares the caches with the data: 2 us at 16 KiB, 5 at 256 KiB)
        return [Target(0, "shm", engine.size, "shm", lambda buf: api.allreduce_(buf, "sum"),
                       shm_bounds(engine))]
    multidim = engine.multidim
    transport = engine.name.split("/")[-1]
    out = []
    for k, d in enumerate(multidim.dims):
        if isinstance(d, GroupDim):
            d.fixed = "native"
        outermost = k == len(multidim.dims) - 1
        shm = isinstance(d, ShmDim)
        out.append(Target(d.index, "shm" if shm else transport, d.size,
                          "shm" if shm else "native", _phases(d, outermost, f32),
                          # an inner dimension reduce-scatters: no one-step path there
                          shm_bounds(d.engine, one_step=outermost) if shm else ()))
        if isinstance(d, GroupDim) and d.second is not None:
            # Gloo beside MPI: its own collective measured too, so that mode b can price
            # both engines per size (GroupDim.second_link)
            beside = copy.copy(d)
            beside.fixed = f"{d.second.name}:native"
            out.append(Target(d.index, d.second.name, d.size, "native",
                              _phases(beside, outermost, f32)))
    return out


def shm_bounds(engine, one_step: bool = True) -> tuple[int, ...]:
    """Where the shared-memory engine's allreduce changes cost: above its one-step size
    (``DDL_SHM_SMALL_BYTES``, ``one_step``) it reduce-scatters and allgathers; from
    ``cache_edge`` its data no longer fits the last-level cache; with cross-memory reads
    (``DDL_SHM_CMA``, agreed at start) it reads its peers' private buffers directly from
    ``cma.MIN_BYTES``. Any other engine: none."""
    if not isinstance(engine, ShmEngine):
        return ()
    bounds = {cache_edge(engine.size, llc_bytes())}
    if one_step:
        bounds.add(engine.small_bytes + 1)
    if engine.cross_memory:
        bounds.add(CMA_MIN_BYTES)
    return tuple(sorted(bounds))


def cache_edge(ranks: int, llc: int) -> int:
    """The smallest message whose working set on the host stops fitting its last-level
    cache ``llc``: every rank's buffer and its staged copy (2 x ranks x size), rounded down
    to a power of two (2 ranks and 32 MiB: 8 MiB)."""
    fits = max(1, llc // (2 * max(1, ranks)))
    return 1 << (fits.bit_length() - 1)


def _phases(d, outermost: bool, f32) -> Callable[[np.ndarray], None]:
    """What the multi-dimensional allreduce runs on this dimension: the outermost
    allreduces, an inner one reduce-scatters and later allgathers (two calls, each with its
    own synchronisation), which the model prices as one allreduce."""
    from ..grid import even_split
    from ..ops import ReduceOp

    if outermost:
        return lambda buf: d.allreduce(buf, f32, ReduceOp.SUM)

    def run(buf: np.ndarray) -> None:
        counts = even_split(buf.size, d.size)
        d.reduce_scatter(buf, counts, f32, ReduceOp.SUM)
        d.allgather(buf, counts, f32)

    return run


def reduce_gamma(barrier: Callable[[], None], nbytes: int = 16 << 20, reps: int = 5,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per byte of ``np.add`` of two float32 arrays of ``nbytes`` into a third on
    this rank, best of ``reps``, every rank adding at the same moment (``barrier``): the
    model's gamma as this host reduces when the ranks share its memory. The caller agrees
    on the slowest rank's."""
    n = max(1, nbytes // 4)
    a, b, c = np.ones(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.float32)
    best = math.inf
    for _ in range(reps):
        barrier()
        t = clock()
        np.add(a, b, c)
        best = min(best, clock() - t)
    return best / (4 * n)


def measure(target: Target, sizes: list[int], reps: int, barrier: Callable[[], None],
            agree: Callable[[float], float] = lambda t: t,
            clock: Callable[[], float] = time.perf_counter,
            min_seconds: float = 0.25, max_calls: int = 1_000_000) -> list[tuple[int, float]]:
    """(bytes, median seconds per call on this rank) per size. Each repetition times calls
    back to back, as training issues them and as benchmarks/allreduce_worker.py measures, so
    a link shows its sustained cost (a token bucket drained, caches as they stay), not the
    burst a lone call gets after a barrier. The calls per repetition fill ``min_seconds``, from the
    slowest rank's first call (``agree``: the max over ranks), so every rank makes as many."""
    out = []
    for nbytes in sizes:
        buf = np.zeros(max(1, nbytes // 4), np.float32)  # summed in place: stays finite
        barrier()
        target.run(buf)  # untimed: first-touch and plan costs
        barrier()
        t = clock()
        target.run(buf)
        one = agree(clock() - t)
        calls = int(min(max_calls, max(1, math.ceil(min_seconds / max(one, 1e-9)))))
        times = []
        for _ in range(reps):
            barrier()
            t = clock()
            for _ in range(calls):
                target.run(buf)
            times.append((clock() - t) / calls)
        out.append((buf.nbytes, float(np.median(times))))
    return out


def _grid_options(grid: str | None) -> None:
    """Mode b on the job's grid (ranks per host x hosts) unless --grid says otherwise, so
    every dimension across hosts is its own engine group, timed on its native collective
    (``targets`` fixes it), and under MPI has Gloo's group beside it to time as well
    (DDL_GLOO_BESIDE_MPI=1 unless the job said 0: a profile for mode b's engine choice)."""
    from .. import config, options, topology

    world = topology.world_from_env()
    if grid:
        dims = tuple(int(x) for x in grid.split("x"))
    else:
        from ..grid import default_dims

        dims = default_dims(world.size, world.local_size)
    if world.size < 2:
        return
    if config.get("DDL_GLOO_BESIDE_MPI") == "auto":
        os.environ["DDL_GLOO_BESIDE_MPI"] = "1"
    opts = options.parse(config.get("DDL_OPTIONS"))
    os.environ["DDL_OPTIONS"] = dataclasses.replace(opts, mode="b", grid=dims).to_string()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.json",
                   help="where rank 0 writes the profile")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"message sizes timed per dimension (default {DEFAULT_SIZES})")
    p.add_argument("-n", "--iters", type=int, default=5,
                   help="timed repetitions per size, the median kept (5)")
    p.add_argument("--min-seconds", type=float, default=0.25,
                   help="each repetition times calls back to back for at least this long "
                        "(0.25)")
    p.add_argument("--grid", metavar="AxB", help="grid to calibrate (default: ranks per "
                                                 "host x hosts)")


def _slowest(seconds: float) -> float:
    import ddl

    return float(ddl.allreduce(np.array([seconds]), op=ddl.Max)[0])


def calibrate_main(args: argparse.Namespace) -> int:
    import ddl

    from .. import DDLError, api
    sizes = size_list(args.sizes)
    if len(set(sizes)) < 2 or args.iters < 1:
        print("ddl-perf calibrate: give two or more --sizes and -n >= 1", file=sys.stderr)
        return 2
    try:
        _grid_options(args.grid)
        ddl.init()
    except DDLError as exc:
        print(f"ddl-perf calibrate: {exc}", file=sys.stderr)
        return 2
    try:
        found = targets(api.job_engine())
        if not found:
            print("ddl-perf calibrate: one rank has nothing to measure; run it inside a "
                  "job (ddlrun -n 4 ddl-perf calibrate ...)", file=sys.stderr)
            return 2
        # the host's reduction speed first: the fit holds it fixed (module docstring)
        gamma = float(ddl.allreduce(np.array([reduce_gamma(ddl.barrier)]), op=ddl.Max)[0])
        rows = []
        for target in found:
            local = measure(target, sizes, args.iters, ddl.barrier, _slowest,
                            min_seconds=args.min_seconds)
            # the dimension is as slow as its slowest member: agree on the max
            worst = ddl.allreduce(np.array([t for _, t in local]), op=ddl.Max)
            rows += [{"dim": target.index, "engine": target.engine, "size": target.size,
                      "algorithm": target.algorithm, "bytes": b, "seconds": float(t)}
                     for (b, _), t in zip(local, worst, strict=True)]
        whole = _whole_calls(api.job_engine(), sizes, args)
        if ddl.rank() == 0:
            profile = fit_profile(rows, socket.gethostname(), gamma,
                                  {t.index: t.bounds for t in found})
            if whole:
                profile = with_call_overhead(profile, whole, api.job_engine())
            cost.save_profile(profile, args.output)
            print(format_profile(profile))
            print(f"# wrote {args.output}; use it with DDL_COST_PROFILE={args.output}")
        return 0
    finally:
        ddl.shutdown()


def _whole_calls(engine, sizes: list[int], args: argparse.Namespace) -> list[dict]:
    """Across hosts, the job's whole allreduce (``ddl.allreduce_``, its identity round and
    every dimension at once) at the sizes of one pipeline chunk that do not ride on the
    round, under 1 MiB, and at ``RIDE_BYTES``, which rides on the round: rows for
    ``with_call_overhead``. None on one host, where ``targets`` times the whole call."""
    import ddl

    if not isinstance(engine, DimsEngine):
        return []  # one host: its one dimension was timed as the whole call (targets)
    picked = [s for s in sizes if FOLD_BYTES < s < (1 << 20) and s <= _chunk_bytes(engine)]
    picked.insert(0, RIDE_BYTES)  # one that rides on the round: Profile.round_s
    call = Target(-1, "call", engine.size, "multidim", lambda buf: ddl.allreduce_(buf, ddl.Sum))
    local = measure(call, picked, args.iters, ddl.barrier, _slowest,
                    min_seconds=args.min_seconds)
    worst = ddl.allreduce(np.array([t for _, t in local]), op=ddl.Max)
    return [{"dim": "call", "bytes": b, "seconds": float(t)}
            for (b, _), t in zip(local, worst, strict=True)]


def _chunk_bytes(engine) -> int:
    """The pipeline's chunk (the multi-host engine's; the configured one on one host)."""
    if isinstance(engine, DimsEngine):
        return engine.multidim.chunk_bytes
    return config.get("DDL_CHUNK_BYTES")


def with_call_overhead(profile: cost.Profile, whole: list[dict], engine) -> cost.Profile:
    """``profile`` with ``call_overhead_s``: the median over the calls of ``whole`` that do
    not ride on the identity round of what each took beyond the model's price for it on
    the fitted links (its dimensions' pipeline and its identity round), never below 0; and
    with ``round_s``: the median of those that ride on it. Across hosts only (one host
    times its whole call as its dimension). Pure but for the engine's chunk size."""
    dims = [(d.algorithm, d.size, d.link) for d in profile.job_dims()]
    chunk = _chunk_bytes(engine)
    riding = [r["seconds"] for r in whole if r["bytes"] <= FOLD_BYTES]
    left = [r["seconds"] - cost.pipeline_time(dims, r["bytes"], chunk)
            - cost.identity_round_time(dims) for r in whole if r["bytes"] > FOLD_BYTES]
    return dataclasses.replace(profile, call_overhead_s=max(0.0, float(np.median(left)))
                               if left else 0.0,
                               round_s=float(np.median(riding)) if riding else 0.0,
                               measured=tuple(profile.measured) + tuple(whole))


def regime_span(lo: float, hi: float) -> str:
    """Sizes in [lo, hi) as people write them: '<= 64 KiB', '> 64 KiB, < 8 MiB',
    '>= 8 MiB' (a bound one above a round size is that size's '>')."""
    def low(x: float) -> str:
        return f"> {size_label(x - 1)}" if x % 1024 == 1 else f">= {size_label(x)}"

    if lo <= 0:
        return f"<= {size_label(hi - 1)}" if hi % 1024 == 1 else f"< {size_label(hi)}"
    return low(lo) if not math.isfinite(hi) else f"{low(lo)}, < {size_label(hi)}"


def format_profile(profile: cost.Profile) -> str:
    lines = [f"# ddl-perf calibrate on {profile.machine}: T = steps*alpha + wire*beta + "
             "reduced*gamma (ddl/cost.py)",
             f"# {'dim':>3} {'engine':>6} {'size':>4} {'alg':>6} {'alpha us':>9} "
             f"{'GB/s (1/beta)':>13} {'worst fit err':>13}"]
    for d in profile.dims:
        rows = profile.rows(d)
        err = max((abs(cost.allreduce_time(d.algorithm, d.size, r["bytes"], d.link)
                       / r["seconds"] - 1) for r in rows), default=0.0)
        bw = 1 / d.link.beta / 1e9 if d.link.beta else float("inf")
        lines.append(f"  {d.index:>3} {d.engine:>6} {d.size:>4} {d.algorithm:>6} "
                     f"{d.link.alpha * 1e6:>9.2f} {bw:>13.3f} {err:>12.1%}")
        for lo, hi, alpha, beta, gamma in d.link.regimes:
            own = (f"  reduces at {1 / gamma / 1e9:.1f} GB/s" if gamma != d.link.gamma and gamma
                   else "")
            lines.append(f"      {regime_span(lo, hi):>21}: {alpha * 1e6:>9.2f} "
                         f"{(1 / beta / 1e9 if beta else math.inf):>13.3f}{own}")
    calls = sorted(r["bytes"] for r in profile.measured
                   if r.get("dim") == "call" and r["bytes"] > FOLD_BYTES)
    if profile.round_s:
        lines.append(f"# a call that rides on the identity round: "
                     f"{profile.round_s * 1e6:.0f} us (whole calls of {RIDE_BYTES} B)")
    if calls:
        lines.append(f"# per call beyond the dimensions and the identity round: "
                     f"{profile.call_overhead_s * 1e6:.0f} us (whole calls of "
                     f"{size_label(calls[0])} to {size_label(calls[-1])})")
    return "\n".join(lines)
