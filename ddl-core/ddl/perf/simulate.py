"""``ddl-perf simulate``: the library's own cost model (ddl/cost.py) asked "what would this
cluster give?".

Two questions:
- allreduce time per message size on a grid (``--grid``, ``--links`` or a calibrated
  ``--profile`` / ``DDL_COST_PROFILE``): a flat ring on the slowest link against the DDL
  multi-dimensional allreduce, played out chunk by chunk as ddl runs it
  (``cost.pipeline_time``), with each dimension's algorithm picked as mode ``b`` picks it.
- training scaling efficiency from 1 to 10,000+ GPUs for a described cluster and model
  (``--preset`` or ``--scaling``): weak scaling keeps the batch per GPU; strong scaling
  caps the global batch, so beyond the cap each GPU's batch (and compute per step) shrinks
  while the gradient to allreduce does not.

The training model, per step on N GPUs with b samples per GPU:
  compute  = train FLOPs per sample x b / (peak x utilization); backward = 2/3 of it
  comm     = allreduce time of the gradient (multi-dimensional, or the flat ring)
  exposed  = max(0, comm - overlap x backward)
  step     = compute + exposed;  efficiency = (b / step) / (b_1 / compute_1)
It leaves out stragglers, input loading, optimizer time and small-batch GPU inefficiency,
so it is an upper bound on what a real run reaches.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .. import config, cost
from ..errors import DDLConfigError
from .allreduce_model import (  # noqa: F401  (re-exported: the simulator's model)
    allreduce_row,
    links_from_profile,
    links_from_spec,
    network_candidates,
    plan_dims,
)
from .plot import PlotError, render
from .presets import PRESETS, Cluster
from .sizes import size_list


# --------------------------------------------------------------------------- training
@dataclass(frozen=True)
class Point:
    gpus: int
    grid: tuple[int, ...]
    batch_per_gpu: float
    compute_s: float
    comm_s: float
    exposed_s: float
    efficiency: float
    flat_efficiency: float


def grid_for(c: Cluster, gpus: int) -> tuple[int, ...]:
    """Fill a host, then a rack, then racks (IBM DDL's X x Y x Z)."""
    g, h = c.gpus_per_host, c.hosts_per_rack
    if gpus <= g:
        return (gpus,)
    if gpus <= g * h:
        return (g, -(-gpus // g))
    return (g, h, -(-gpus // (g * h)))


def comm_time(c: Cluster, grid: tuple[int, ...], flat: bool = False) -> float:
    nbytes = c.grad_bytes
    links = [(alg if alg != "best" else "net", link)
             for alg, link in zip(c.algorithms, c.links, strict=True)][: len(grid)]
    if math.prod(grid) <= 1:
        return 0.0
    if flat:
        slowest = max((lk for _, lk in links), key=lambda lk: lk.beta)
        return cost.allreduce_time("ring", math.prod(grid), nbytes, slowest)
    dims = plan_dims(list(grid), links, nbytes)
    if c.hierarchy == "reduce-bcast" and len(dims) > 1:
        # Goyal et al.: reduce inside the server, allreduce the whole buffer across servers
        # (each dimension after the first on the full gradient), broadcast back
        inner = dims[0]
        t = cost.reduce_scatter_time(inner[0], inner[1], nbytes, inner[2]) * 2
        return t + sum(cost.allreduce_time(a, n, nbytes, lk) for a, n, lk in dims[1:])
    return cost.pipeline_time(dims, nbytes, c.chunk_bytes)


def step(c: Cluster, gpus: int, strong: bool) -> Point:
    batch = float(c.batch_per_gpu)
    if strong and c.global_batch_cap:
        batch = min(batch, c.global_batch_cap / gpus)
    flops = c.peak_flops * c.utilization
    compute = c.train_flops_per_sample * batch / flops
    base = c.train_flops_per_sample * c.batch_per_gpu / flops
    grid = grid_for(c, gpus)

    def efficiency(comm: float) -> tuple[float, float]:
        exposed = max(0.0, comm - c.overlap * compute * 2 / 3)
        return exposed, (batch / (compute + exposed)) / (c.batch_per_gpu / base)

    comm = comm_time(c, grid)
    exposed, eff = efficiency(comm)
    _, flat_eff = efficiency(comm_time(c, grid, flat=True))
    return Point(gpus, grid, batch, compute, comm, exposed, eff, flat_eff)


def gpu_counts(c: Cluster, top: int | None = None) -> list[int]:
    top = top or max(c.max_gpus, 10_240)
    counts, n = [], 1
    while n <= top:
        counts.append(n)
        n *= 2
    for extra in (c.published.gpus if c.published else 0, c.max_gpus, top):
        if extra and extra <= top and extra not in counts:
            counts.append(extra)
    return sorted(counts)


def relative_to(points: list[Point], base_gpus: int, gpus: int) -> float:
    """Efficiency at ``gpus`` measured against ``base_gpus`` (Goyal's baseline is a server)."""
    by = {p.gpus: p for p in points}
    b, p = by[base_gpus], by[gpus]
    return (p.batch_per_gpu / (p.compute_s + p.exposed_s)) / (
        b.batch_per_gpu / (b.compute_s + b.exposed_s))


# --------------------------------------------------------------------------- CLI
def _count(text: str) -> float:
    """A count with an optional decimal suffix: 25.6M parameters, 24.6G FLOPs."""
    units = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    t = text.strip().upper()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want a number with an optional K, M, "
                                         "G, T or P suffix, e.g. 25.6M") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def parse_grid(text: str, most: int | None = None) -> list[int]:
    """--grid: positive sizes joined by x, innermost first (at most ``most`` of them)."""
    try:
        sizes = [int(d) for d in text.lower().split("x")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or (most and len(sizes) > most):
        want = (f"1 to {most} positive sizes joined by x, GPUs per host x hosts per rack x "
                "racks (e.g. 4x16x4)" if most else "positive sizes joined by x (e.g. 4x16x4)")
        raise ValueError(f"--grid {text!r}: want {want}")
    return sizes


# flags that describe the training run: what --preset/--scaling use, refused without them
SCALING_FLAGS = ("gpus", "peak_tflops", "utilization", "params", "grad_bytes",
                 "flops_per_sample", "batch", "overlap", "global_batch")
# flags that change the cluster or the model: the preset's published figure no longer applies
DESCRIBING_FLAGS = ("grid", "links", "profile", "chunk_bytes", "peak_tflops", "utilization",
                    "params", "grad_bytes", "flops_per_sample")


def add_arguments(sm: argparse.ArgumentParser) -> None:
    sm.add_argument("--grid", help="ranks per host x hosts per rack x racks (allreduce "
                                   "default: 4x16x4; with --preset/--scaling it replaces the "
                                   "preset's GPUs per host x hosts per rack x racks)")
    sm.add_argument("--sizes", help="allreduce message sizes (default: 1M,16M,100M,1G)")
    sm.add_argument("--links", help="per dimension: name,alpha seconds,bytes/s"
                                    "[,reduce bytes/s] (';'-separated, the last repeated for "
                                    "further dimensions); name shm = shared memory, ring, hd "
                                    "or native = that algorithm, anything else a network "
                                    "dimension (mode b picks its algorithm); allreduce "
                                    "default: shared memory, then 100 Gb/s links")
    sm.add_argument("--profile", metavar="PROFILE.json",
                    help="links from ddl-perf calibrate (allreduce default: "
                         "DDL_COST_PROFILE when set; overrides --links)")
    sm.add_argument("--chunk-bytes", type=config._size, default=None, metavar="BYTES",
                    help="pipeline chunk, as DDL_CHUNK_BYTES (default: its value, 8M)")
    sm.add_argument("--plot", metavar="FILE.png|.svg",
                    help="also draw it: time vs size, or efficiency vs GPUs")
    sm.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    tr = sm.add_argument_group(
        "training scaling", "A preset's cluster and model (--preset, default powerai-2017), "
        "each flag replacing one of its figures")
    tr.add_argument("--preset", choices=sorted(PRESETS),
                    help="training scaling of a published cluster, next to its paper")
    tr.add_argument("--scaling", choices=("weak", "strong", "both"),
                    help="training scaling table (default with --preset: both)")
    tr.add_argument("--gpus", type=int, metavar="N", help="largest GPU count (10240)")
    tr.add_argument("--peak-tflops", type=_count, metavar="F",
                    help="per GPU, in the precision trained in")
    tr.add_argument("--utilization", type=float, metavar="U",
                    help="achieved fraction of the peak (0..1]")
    tr.add_argument("--params", type=_count, metavar="N", help="model parameters (25.6M)")
    tr.add_argument("--grad-bytes", type=int, choices=(1, 2, 4, 8),
                    help="bytes per gradient element allreduced (4: fp32, 2: bf16/fp16)")
    tr.add_argument("--flops-per-sample", type=_count, metavar="F",
                    help="training FLOPs per sample, forward + backward (ResNet-50: 24.6G)")
    tr.add_argument("--batch", type=int, metavar="B", help="samples per GPU")
    tr.add_argument("--overlap", type=float, metavar="F",
                    help="fraction of backward that communication hides behind (0..1)")
    tr.add_argument("--global-batch", type=int, metavar="B",
                    help="strong scaling's cap on the global batch")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(args: argparse.Namespace, dests: Sequence[str]) -> list[str]:
    return [d for d in dests if getattr(args, d, None) is not None]


def _algorithm(name: str) -> str:
    """A --links or profile dimension name as a Cluster algorithm: shm and the fixed network
    algorithms stay, anything else is mode b's pick."""
    return name if name in ("shm", "ring", "hd", "native") else "best"


def _cluster(args: argparse.Namespace) -> Cluster:
    """The preset (default powerai-2017) with each flag given replacing its figure."""
    base = PRESETS[args.preset or "powerai-2017"]
    changes: dict = {}
    if args.grid is not None:
        dims = parse_grid(args.grid, most=3) + [1, 1]
        changes.update(gpus_per_host=dims[0], hosts_per_rack=dims[1], racks=dims[2])
    if args.profile is not None or args.links is not None:
        named = (links_from_profile(cost.load_profile(args.profile), 3) if args.profile
                 else links_from_spec(args.links))
        named = (named + [named[-1]] * 3)[:3]
        changes.update(links=tuple(lk for _, lk in named),
                       algorithms=tuple(_algorithm(n) for n, _ in named))
    if args.peak_tflops is not None:
        changes["peak_flops"] = args.peak_tflops * 1e12
    if args.utilization is not None:
        if not 0 < args.utilization <= 1:
            raise ValueError(f"--utilization {args.utilization}: want a fraction in (0, 1]")
        changes["utilization"] = args.utilization
    if args.overlap is not None:
        if not 0 <= args.overlap <= 1:
            raise ValueError(f"--overlap {args.overlap}: want a fraction in [0, 1]")
        changes["overlap"] = args.overlap
    for dest, fieldname in (("params", "params"), ("grad_bytes", "bytes_per_grad"),
                            ("flops_per_sample", "train_flops_per_sample"),
                            ("batch", "batch_per_gpu"), ("global_batch", "global_batch_cap"),
                            ("chunk_bytes", "chunk_bytes")):
        value = getattr(args, dest)
        if value is not None:
            if value < 1:
                raise ValueError(f"{_flag(dest)} {value}: must be at least 1")
            changes[fieldname] = int(value) if dest != "flops_per_sample" else value
    if not changes:
        return base
    described = _given(args, DESCRIBING_FLAGS)
    words = " ".join(f"{_flag(d)} {getattr(args, d)}"
                     for d in _given(args, dict.fromkeys(DESCRIBING_FLAGS + SCALING_FLAGS))
                     if d != "gpus")
    if described:  # another cluster or model: the paper's figure is not its prediction
        return base.with_(name=f"custom cluster (from {args.preset or 'powerai-2017'}: "
                               f"{words})", published=None, notes=(), **changes)
    return base.with_(name=f"{base.name}; {words}", **changes)


def simulate_main(args: argparse.Namespace) -> int:
    scaling = bool(args.preset or args.scaling)
    try:
        if not scaling and _given(args, SCALING_FLAGS):
            raise ValueError(f"{_flag(_given(args, SCALING_FLAGS)[0])} describes training "
                             "scaling: add --scaling weak|strong|both or --preset NAME")
        if scaling and args.sizes is not None:
            raise ValueError("--sizes is for allreduce time on a grid: drop --preset and "
                             "--scaling, or drop --sizes")
        return _scaling(args) if scaling else _allreduce(args)
    except (ValueError, DDLConfigError) as exc:
        print(f"ddl-perf simulate: {exc}", file=sys.stderr)
        return 2


def _allreduce(args: argparse.Namespace) -> int:
    import json

    grid = args.grid or "4x16x4"
    sizes = parse_grid(grid)
    profile = (cost.load_profile(args.profile) if args.profile else cost.env_profile())
    overhead = round_s = 0.0
    if profile is not None:
        links = links_from_profile(profile, len(sizes))
        # measured on the profile's own grid; another grid's hand-offs are not known
        if sizes == [d.size for d in profile.job_dims()]:
            overhead, round_s = profile.call_overhead_s, profile.round_s
        source = f"profile {args.profile or config.get('DDL_COST_PROFILE')} ({profile.machine})"
    else:
        links = links_from_spec(args.links or
                                "shm,10e-6,5e9;net,50e-6,12.5e9;net,50e-6,12.5e9")
        links += [links[-1]] * (len(sizes) - len(links))
        links = links[: len(sizes)]
        source = "--links"
    chunk = args.chunk_bytes or config.get("DDL_CHUNK_BYTES")
    rows = [allreduce_row(sizes, links, n, chunk, overhead, round_s)
            for n in size_list(args.sizes or "1M,16M,100M,1G")]
    print(f"# ddl-perf simulate: grid {grid} = {math.prod(sizes)} ranks; alpha-beta "
          f"model (ddl/cost.py), links from {source}, {chunk >> 10} KiB chunks")
    print(f"# {'size':>10} {'flat ring':>12} {'multi-dim':>12} {'pipelined':>12} {'gain':>6}"
          "  algorithms")
    for r in rows:
        print(f"  {r['bytes']:>10} {r['flat_s'] * 1e3:>10.2f}ms {r['multidim_s'] * 1e3:>10.2f}ms"
              f" {r['pipelined_s'] * 1e3:>10.2f}ms {r['flat_s'] / r['pipelined_s']:>5.1f}x  "
              f"{','.join(r['algorithms'])}")
    doc = {"tool": "ddl-perf", "kind": "simulate", "grid": sizes, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        _draw(args.plot, [("simulate", doc)])
    return 0


def _scaling(args: argparse.Namespace) -> int:
    import json

    c = _cluster(args)
    kinds = {"weak": ["weak"], "strong": ["strong"]}.get(args.scaling or "both",
                                                          ["weak", "strong"])
    counts = gpu_counts(c, args.gpus)
    # past the cap a GPU would get less than one sample: strong scaling ends there
    usable = [n for n in counts if not c.global_batch_cap or n <= c.global_batch_cap]
    series = {k: [step(c, n, k == "strong") for n in (usable if k == "strong" else counts)]
              for k in kinds}
    _print_scaling(c, series)
    if "strong" in kinds and len(usable) < len(counts):
        print(f"# strong scaling stops at {usable[-1]} GPUs: beyond the global batch cap "
              f"({c.global_batch_cap}) a GPU would get less than one sample")
    if c.published and c.published.gpus in counts:
        _print_published(c, series[kinds[0]])
    doc = scaling_doc(c, series)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=list)
    if args.plot:
        _draw(args.plot, [("simulate-scaling", doc)])
    return 0


def scaling_doc(c: Cluster, series: dict[str, list[Point]]) -> dict:
    """The JSON twin of a scaling table, which ``ddl-perf plot`` draws."""
    pub = c.published
    return {"tool": "ddl-perf", "kind": "simulate-scaling", "cluster": c.name,
            "published": None if pub is None else {
                "efficiency": pub.efficiency, "gpus": pub.gpus,
                "baseline_gpus": pub.baseline_gpus, "source": pub.source},
            "series": {k: [dict(p.__dict__, grid=list(p.grid)) for p in v]
                       for k, v in series.items()}}


def _draw(path: str, loaded: list[tuple[str, dict]]) -> None:
    try:
        render(loaded, path)
    except PlotError as exc:
        raise ValueError(f"--plot: {exc}") from None
    print(f"# wrote {path}")


def _print_scaling(c: Cluster, series: dict[str, list[Point]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{c.name}: predicted scaling (ddl/cost.py)", title_justify="left")
    for col in ("GPUs", "grid", "scaling", "batch/GPU", "compute ms", "allreduce ms",
                "exposed ms", "efficiency", "flat ring eff."):
        table.add_column(col, justify="right")
    for kind, points in series.items():
        for p in points:
            table.add_row(str(p.gpus), "x".join(map(str, p.grid)), kind,
                          f"{p.batch_per_gpu:.3g}", f"{p.compute_s * 1e3:.1f}",
                          f"{p.comm_s * 1e3:.2f}", f"{p.exposed_s * 1e3:.2f}",
                          f"{p.efficiency:.1%}", f"{p.flat_efficiency:.1%}")
    Console(width=120).print(table)
    print(f"# gradient {c.grad_bytes / 1e6:.1f} MB, {c.peak_flops * c.utilization / 1e12:.1f} "
          f"TFLOP/s achieved per GPU (utilization {c.utilization:.0%}, an assumption), "
          f"overlap {c.overlap:.0%}, global batch cap {c.global_batch_cap}")
    for note in c.notes:
        print(f"# {note}")


def _print_published(c: Cluster, weak: list[Point]) -> None:
    pub = c.published
    predicted = relative_to(weak, pub.baseline_gpus, pub.gpus)
    base = "1 GPU" if pub.baseline_gpus == 1 else f"{pub.baseline_gpus} GPUs"
    print(f"# at {pub.gpus} GPUs against {base}: predicted {predicted:.1%}, published "
          f"{pub.efficiency:.0%} ({pub.source})")
    print(f"# {explain(predicted, pub.efficiency)}")
    if c.overlap:
        hidden = [step(c.with_(overlap=0.0), n, False) for n in (pub.baseline_gpus, pub.gpus)]
        print(f"# sensitivity: with no overlap (--overlap 0) the model gives "
              f"{relative_to(hidden, pub.baseline_gpus, pub.gpus):.1%}")


def explain(predicted: float, published: float) -> str:
    """One honest sentence about the gap: the model only counts compute and allreduce."""
    gap = predicted - published
    if abs(gap) <= 0.02:
        return ("within 2 points: the step is compute-bound and the allreduce's exposed "
                "part is what the paper lost")
    if gap > 0:
        return (f"the model is {gap:.0%} points optimistic: it leaves out stragglers and "
                "synchronization jitter, input loading, optimizer and framework overhead and "
                "network contention, which a real run pays; no parameter was tuned to close "
                "the gap")
    return (f"the model is {-gap:.0%} points pessimistic: its link latencies, bandwidths or "
            "the assumed utilization/overlap are worse than what the run achieved; no "
            "parameter was tuned to close the gap")
