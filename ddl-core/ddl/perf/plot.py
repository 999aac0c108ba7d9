"""``ddl-perf plot RESULTS.json... -o OUT.png|.svg``: bus bandwidth against message size,
one line per engine (log-log), from ``ddl-perf allreduce`` & co ``--json`` files;
throughput against ranks with the ideal line from ``ddl-perf scale --json`` files; the
simulator's predicted allreduce time against the measured one, from ``ddl-perf simulate
--json`` with the ``allreduce --json`` files of the same call; predicted scaling efficiency
from ``simulate --preset/--scaling --json``, with the efficiency of the ``scale --json``
files of the same call on it; and a cost profile's fit
against what calibrate measured (``ddl-perf calibrate -o`` files). Which kind a file is
comes from the file (``kind_of``); each kind present gives one panel.

matplotlib is optional: without it ``plot`` and ``scale --plot`` stop with one line that
names it. Figures are drawn on ``matplotlib.figure.Figure`` (no pyplot, no GUI backend).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .sizes import size_label


class PlotError(Exception):
    """A file that cannot be drawn, or no matplotlib; the message says which and why."""


COLLECTIVE, SCALE, SIMULATE, PROFILE = "collective", "scale", "simulate", "profile"
SIM_SCALING = "simulate-scaling"
VALIDATION = "sim-validation"  # benchmarks/sim_validation.py --json


def kind_of(doc: Any) -> str:
    """``collective`` for an allreduce/allgather/... --json document (or a list of them,
    as --ranks writes), ``scale`` for a scale --json one; PlotError for anything else."""
    items = doc if isinstance(doc, list) else [doc]
    if items and all(isinstance(d, dict) and d.get("tool") == "ddl-perf" for d in items):
        if all("collective" in d and "results" in d for d in items):
            return COLLECTIVE
        if len(items) == 1 and items[0].get("kind") == SCALE:
            return SCALE
        if len(items) == 1 and items[0].get("kind") == SIMULATE and "rows" in items[0]:
            return SIMULATE
        if len(items) == 1 and items[0].get("kind") == SIM_SCALING and "series" in items[0]:
            return SIM_SCALING
        if len(items) == 1 and items[0].get("kind") == "train":
            raise PlotError("a single `ddl-perf train --json` result has nothing to draw "
                            "against: plot the output of `ddl-perf scale --json`")
    if isinstance(doc, dict) and "dims" in doc and "version" in doc:
        return PROFILE  # ddl-perf calibrate -o (checked in full when drawn)
    if isinstance(doc, dict) and doc.get("kind") == VALIDATION and "rows" in doc:
        return VALIDATION
    raise PlotError("not a ddl-perf result: want the --json of ddl-perf allreduce (or "
                    "allgather, broadcast, reduce_scatter, alltoall), of ddl-perf scale or "
                    "of ddl-perf simulate, a ddl-perf calibrate profile or the --json of "
                    "benchmarks/sim_validation.py")


def load(path: str) -> tuple[str, Any]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise PlotError(f"{path}: {exc}") from None
    try:
        return kind_of(doc), doc
    except PlotError as exc:
        raise PlotError(f"{path}: {exc}") from None


def busbw_series(docs: Sequence[Any], in_place: bool = False
                 ) -> dict[str, list[tuple[int, float]]]:
    """Label -> [(size in bytes, busbw GB/s)] sorted by size. The label is the engine,
    with the collective and the rank count added when the files hold more than one."""
    rows = [r for d in docs for item in (d if isinstance(d, list) else [d])
            for r in item["results"]]
    colls = {r["experiment_name"] for r in rows}
    ranks = {r["ranks"] for r in rows}
    part = "in_place" if in_place else "out_of_place"
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        label = r["engine"]
        if len(colls) > 1:
            label = f"{r['experiment_name']} {label}"
        if len(ranks) > 1:
            label += f" ({r['ranks']} ranks)"
        series.setdefault(label, []).append((int(r["size"]), float(r[part]["bus_bw"])))
    return {k: sorted(v) for k, v in series.items()}


def roofline_series(docs: Sequence[Any], in_place: bool = False
                    ) -> dict[str, list[tuple[int, float]]]:
    """Label -> [(size in bytes, busbw GB/s at the memory roofline)] of the rows that have
    a roofline (``ddl-perf ... --json``: ``roofline`` = bound time / time, so the bound's
    busbw is the row's busbw / roofline), one line per rank count."""
    part = "in_place" if in_place else "out_of_place"
    series: dict[str, dict[int, float]] = {}
    for d in docs:
        for item in (d if isinstance(d, list) else [d]):
            bw = item.get("memory_bandwidth")
            for r in item["results"]:
                frac = r[part].get("roofline")
                if bw and frac and float(r[part]["bus_bw"]) > 0:
                    label = (f"memory roofline, {r['ranks']} ranks "
                             f"({float(bw['bound_gbs']):.0f} GB/s per host)")
                    series.setdefault(label, {})[int(r["size"])] = \
                        float(r[part]["bus_bw"]) / float(frac)
    return {k: sorted(v.items()) for k, v in series.items()}


def collective_title(docs: Sequence[Any], in_place: bool) -> str:
    """What the busbw panel shows: collective(s), rank counts, hosts, engines, placement."""
    import re

    items = [i for d in docs for i in (d if isinstance(d, list) else [d])]
    colls = sorted({i["collective"] for i in items})
    ranks = sorted({int(r["ranks"]) for i in items for r in i["results"]})
    engines = list(dict.fromkeys(r["engine"] for i in items for r in i["results"]))
    hosts = sorted({m.group(1) for i in items for line in i.get("devices", [])
                    if (m := re.search(r" on +(\S+) device", line))})
    dtype = sorted({str(i.get("config", {}).get("datatype", "")) for i in items} - {""})
    return (f"{', '.join(colls)}, {'/'.join(map(str, ranks))} ranks"
            + (f" on {', '.join(hosts)}" if hosts else "")
            + f" ({', '.join(dtype)}{', ' if dtype else ''}"
              f"{'in place' if in_place else 'out of place'})\n{' vs '.join(engines)}")


def _size_axis(ax: Any, sizes: Sequence[float]) -> None:
    """Log-2 x axis labelled 8 B / 1 KiB / 1 MiB, at most ~9 labels."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    lo, hi = min(sizes), max(sizes)
    e0, e1 = int(lo).bit_length() - 1, max(int(hi).bit_length() - 1, int(lo).bit_length() - 1)
    step = max(1, -(-(e1 - e0) // 8))
    ax.xaxis.set_major_locator(FixedLocator([2.0 ** e for e in range(e0, e1 + 1, step)]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v)))
    ax.set_xlim(lo / 1.3, hi * 1.3)
    ax.set_xlabel("message size")


def _fit_log_y(ax: Any, values: Sequence[float]) -> None:
    """Log y axis around the data (a margin of a fifth of a decade at each end)."""
    vals = [v for v in values if v > 0]
    ax.set_yscale("log")
    if vals:
        ax.set_ylim(min(vals) / 1.6, max(vals) * 1.6)


def _legend_outside(ax: Any) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)


def scale_series(doc: dict) -> tuple[str, list[int], list[float], list[float]]:
    """(label, ranks, measured total throughput, ideal throughput)."""
    pts = doc["points"]
    base = min(pts, key=lambda p: p["ranks"])
    per_rank0 = base["throughput"] / base["ranks"]
    label = f"{doc['model']} via {doc['via']} ({doc['precision']})"
    return (label, [p["ranks"] for p in pts], [p["throughput"] for p in pts],
            [per_rank0 * p["ranks"] for p in pts])


def measured_efficiency(doc: dict) -> tuple[str, list[int], list[float]]:
    """(label, ranks, scaling efficiency against the fewest ranks) of a scale document:
    what a predicted scaling curve is drawn against."""
    label, ranks, got, ideal = scale_series(doc)
    return f"measured: {label}", ranks, [t / i for t, i in zip(got, ideal)]


def measured_times(docs: Sequence[Any], in_place: bool = False
                   ) -> dict[str, list[tuple[int, float]]]:
    """Label -> [(size in bytes, seconds per call)] of the allreduce rows of collective
    documents, sorted by size: what a prediction is drawn against."""
    part = "in_place" if in_place else "out_of_place"
    rows = [r for d in docs for item in (d if isinstance(d, list) else [d])
            for r in item["results"] if r["experiment_name"] == "allreduce"]
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        label = f"measured: {r['engine']} ({r['ranks']} ranks)"
        series.setdefault(label, []).append((int(r["size"]), float(r[part]["time"]) * 1e-6))
    return {k: sorted(v) for k, v in series.items()}


def predicted_times(doc: dict) -> dict[str, list[tuple[int, float]]]:
    """Label -> [(size in bytes, seconds)] of a ``simulate --grid --json`` document: ddl's
    pipelined multi-dimensional allreduce and the flat ring."""
    grid = "x".join(map(str, doc["grid"]))
    rows = sorted(doc["rows"], key=lambda r: r["bytes"])
    ranks = rows[0]["ranks"] if rows else 0
    return {f"predicted: ddl, grid {grid}": [(r["bytes"], r["pipelined_s"]) for r in rows],
            f"predicted: flat ring, {ranks} ranks": [(r["bytes"], r["flat_s"]) for r in rows]}


def profile_series(doc: dict, where: str = "profile"
                   ) -> list[tuple[str, list[tuple[int, float]], list[tuple[int, float]]]]:
    """Per grid dimension of a calibrate profile, and for its whole calls: (label, measured
    [(bytes, seconds)], the fitted model's [(bytes, seconds)] at the same sizes). The model
    of a dimension is the formula calibrate fitted (``cost.allreduce_time`` of what was
    timed); of a whole call, the simulator's (pipeline, identity round, call overhead)."""
    from .. import config, cost
    from ..errors import DDLConfigError
    from .allreduce_model import links_from_profile

    try:
        prof = cost.profile_from_json(doc, where)
    except DDLConfigError as exc:
        raise PlotError(str(exc)) from None
    out = []
    for d in sorted(prof.dims, key=lambda d: d.index):
        got = sorted((int(r["bytes"]), float(r["seconds"])) for r in prof.rows(d))
        model = [(b, cost.allreduce_time(d.algorithm, d.size, b, d.link)) for b, _ in got]
        out.append((f"dim {d.index} ({d.engine}, {d.size} ranks)", got, model))
    calls = sorted((int(r["bytes"]), float(r["seconds"])) for r in prof.measured
                   if r.get("dim") == "call")
    if calls:
        from .allreduce_model import allreduce_row

        sizes = [d.size for d in prof.job_dims()]
        links = links_from_profile(prof, len(sizes))
        chunk = config.get("DDL_CHUNK_BYTES")
        model = [(b, allreduce_row(sizes, links, b, chunk, prof.call_overhead_s, prof.round_s)
                  ["pipelined_s"]) for b, _ in calls]
        out.append(("whole call", calls, model))
    return out


def _figure_cls() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("plotting needs matplotlib, which is not installed "
                        "(pip install matplotlib)") from None
    return Figure


MARKERS = "osD^v<>phX*"


def draw_busbw(ax: Any, docs: Sequence[Any], in_place: bool) -> None:
    drawn, sizes, ys = 0, [], []
    for i, (label, pts) in enumerate(busbw_series(docs, in_place).items()):
        pts = [(s, b) for s, b in pts if b > 0]  # log axes; 1 rank has busbw 0
        if pts:
            ax.plot([s for s, _ in pts], [b for _, b in pts], marker=MARKERS[i % 10],
                    label=label)
            drawn += 1
            sizes += [s for s, _ in pts]
            ys += [b for _, b in pts]
    if not drawn:
        raise PlotError("every busbw is 0 (a 1-rank run moves nothing): measure with 2 or "
                        "more ranks")
    for j, (label, pts) in enumerate(roofline_series(docs, in_place).items()):
        ax.plot([s for s, _ in pts], [b for _, b in pts], color="black", linewidth=1.2,
                linestyle=("--", ":", "-.")[j % 3], label=label)
        ys += [b for _, b in pts]
    _size_axis(ax, sizes)
    _fit_log_y(ax, ys)
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(collective_title(docs, in_place), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    _legend_outside(ax)


def draw_scale(ax: Any, docs: Sequence[dict]) -> None:
    unit = docs[0]["unit"]
    for doc in docs:
        label, ranks, got, ideal = scale_series(doc)
        line = ax.plot(ranks, got, marker="o", label=label)[0]
        ax.plot(ranks, ideal, linestyle="--", color=line.get_color(),
                label=f"ideal (linear from {ranks[0]} rank(s))")
        for n, t, i in zip(ranks, got, ideal):
            ax.annotate(f"{t / i:.0%}", (n, t), textcoords="offset points", xytext=(4, -12))
    ax.set_xlabel("ranks")
    ax.set_ylabel(f"{unit}/s (all ranks)")
    ax.set_title("training throughput vs ranks (labels: scaling efficiency)", fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend_outside(ax)


def _time_axes(ax: Any, title: str) -> None:
    """Size and time axes fitted to what was drawn on ``ax``."""
    xs = [x for line in ax.get_lines() for x in line.get_xdata()]
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    _size_axis(ax, xs)
    _fit_log_y(ax, ys)
    ax.set_ylabel("time per call (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    _legend_outside(ax)


def draw_prediction(ax: Any, sims: Sequence[dict], coll: Sequence[Any], in_place: bool) -> None:
    # predictions are lines (dashed: the flat ring), measurements hollow markers, each in a
    # colour of its own, so that a prediction lying on its measurement stays visible
    for doc in sims:
        for label, pts in predicted_times(doc).items():
            ax.plot([b for b, _ in pts], [t * 1e3 for _, t in pts], linewidth=1.5,
                    linestyle="--" if "flat ring" in label else "-", label=label)
    measured = measured_times(coll, in_place)
    for i, (label, pts) in enumerate(measured.items()):
        ax.plot([b for b, _ in pts], [t * 1e3 for _, t in pts], marker=MARKERS[i % 10],
                markersize=7, markerfacecolor="none", markeredgewidth=1.5, linestyle="none",
                label=label)
    grids = ", ".join("x".join(map(str, d["grid"])) for d in sims)
    _time_axes(ax, f"allreduce, grid {grids}: predicted (lines)"
               + (" vs measured (markers)" if measured else ""))


def draw_sim_scaling(ax: Any, sims: Sequence[dict], scales: Sequence[dict]) -> None:
    for doc in sims:
        for kind, points in doc["series"].items():
            xs = [p["gpus"] for p in points]
            line = ax.plot(xs, [p["efficiency"] for p in points], marker="o",
                           label=f"predicted: DDL multi-dim, {kind}")[0]
            ax.plot(xs, [p["flat_efficiency"] for p in points], linestyle="--",
                    color=line.get_color(), label=f"predicted: flat ring, {kind}")
        pub = doc.get("published")
        if pub:
            ax.scatter([pub["gpus"]], [pub["efficiency"]], marker="*", s=160, color="black",
                       zorder=5, label=f"published ({pub['source']})")
    for doc in scales:
        label, ranks, eff = measured_efficiency(doc)
        ax.plot(ranks, eff, marker="s", linestyle=":", label=label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("GPUs (ranks)")
    ax.set_ylabel("scaling efficiency")
    ax.set_title("; ".join(d["cluster"] for d in sims), fontsize=8)
    ax.grid(True, alpha=0.3)
    _legend_outside(ax)


def draw_profile(ax: Any, docs: Sequence[dict]) -> None:
    drawn = 0
    for doc in docs:
        for label, got, model in profile_series(doc):
            if not got:
                continue
            line = ax.plot([b for b, _ in model], [t * 1e3 for _, t in model],
                           label=f"{label}: fit")
            ax.plot([b for b, _ in got], [t * 1e3 for _, t in got], marker="o",
                    markerfacecolor="none", linestyle="none", color=line[0].get_color(),
                    label=f"{label}: measured")
            drawn += 1
    if not drawn:
        raise PlotError("the profile holds no measured rows to draw (write it with "
                        "`ddl-perf calibrate -o`)")
    _time_axes(ax, "calibrate: fitted model (lines) vs measured (hollow markers)")


def draw_validation(ax: Any, docs: Sequence[dict]) -> None:
    """benchmarks/sim_validation.py's medians: per grid the prediction as a line and the
    measurement as hollow markers in its colour."""
    for doc in docs:
        rows = sorted(doc["rows"], key=lambda r: r["bytes"])
        hosts, per = doc.get("hosts"), doc.get("per_host")
        where = (f"{hosts} host{'s' if hosts != 1 else ''} x {per} ranks" if hosts and per
                 else f"grid {doc.get('grid', '?')}")
        line = ax.plot([r["bytes"] for r in rows], [r["predicted_s"] * 1e3 for r in rows],
                       label=f"{where}: predicted")
        ax.plot([r["bytes"] for r in rows], [r["measured_s"] * 1e3 for r in rows],
                marker="o", markersize=7, markerfacecolor="none", markeredgewidth=1.5,
                linestyle="none", color=line[0].get_color(), label=f"{where}: measured")
    _time_axes(ax, "simulator validation: calibrate, then predicted (lines) vs measured "
                   "(hollow markers), medians of rounds")


def render(loaded: Sequence[tuple[str, Any]], out: str, in_place: bool = False) -> None:
    """Draw the loaded (kind, document) pairs into ``out`` (.png or .svg): one panel per
    kind present. Allreduce files given with a simulate file are also drawn against it,
    and scale files' efficiency against a simulated scaling."""
    if not out.lower().endswith((".png", ".svg")):
        raise PlotError(f"-o {out}: give a .png or .svg file name")
    Figure = _figure_cls()
    of = {kind: [d for k, d in loaded if k == kind] for kind in
          (COLLECTIVE, SCALE, SIMULATE, SIM_SCALING, PROFILE, VALIDATION)}
    panels = [kind for kind, docs in of.items() if docs]
    fig = Figure(figsize=(9 * len(panels), 5), layout="constrained")
    for ax, kind in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        if kind == COLLECTIVE:
            draw_busbw(ax, of[kind], in_place)
        elif kind == SCALE:
            draw_scale(ax, of[kind])
        elif kind == SIMULATE:
            draw_prediction(ax, of[kind], of[COLLECTIVE], in_place)
        elif kind == SIM_SCALING:
            draw_sim_scaling(ax, of[kind], of[SCALE])
        elif kind == VALIDATION:
            draw_validation(ax, of[kind])
        else:
            draw_profile(ax, of[kind])
    fig.savefig(out)


def plot_main(args: argparse.Namespace) -> int:
    try:
        render([load(p) for p in args.results], args.output, args.in_place)
    except PlotError as exc:
        print(f"ddl-perf plot: {exc}", file=sys.stderr)
        return 2
    print(f"ddl-perf plot: wrote {args.output}")
    return 0
