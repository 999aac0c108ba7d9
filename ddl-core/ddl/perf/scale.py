"""``ddl-perf scale --ranks 1,2,4 [train flags]``: one ``ddlrun -n N ddl-perf train`` job per
count (``-H``/``--hostfile`` spread it over hosts; ``--via horovod`` starts Horovod's
``horovodrun`` instead, from ``--horovod VENV``), started as a subprocess one after the
other, then throughput and scaling efficiency

    efficiency_N = throughput_N / (N x throughput_1)

(throughput: the job's total images or tokens per second; when 1 is not among the counts,
the smallest count is the base: throughput_N x n0 / (N x throughput_n0)). A rich table on
the terminal, ``--json FILE`` (the points plus every job's train document) and ``--plot
FILE.png`` (measured vs ideal, ``plot.py``); a rich progress display while the jobs run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import train
from .ddlrun_job import DDLRUN, Launch, launch_from_args, stream


def efficiency(points: Sequence[tuple[int, float]]) -> list[float]:
    """Scaling efficiency of each (ranks, total throughput), against the smallest count."""
    if not points:
        return []
    n0, t0 = min(points)
    if t0 <= 0:
        raise ValueError(f"throughput {t0} at {n0} rank(s): must be > 0")
    return [t * n0 / (n * t0) for n, t in points]


def job_argv(ranks: int, train_args: Sequence[str], json_path: str,
             timeout: float = 1800.0, launch: Launch = DDLRUN) -> list[str]:
    """The launcher's command of one count (argv, never a shell line)."""
    return launch.argv(ranks, ["train", *train_args, "--json", json_path], timeout)


def scale_doc(runs: Sequence[dict], train_args: Sequence[str]) -> dict:
    """The scale result from the train documents, one per count (sorted by ranks)."""
    runs = sorted(runs, key=lambda d: d["ranks"])
    eff = efficiency([(d["ranks"], d["throughput"]["total"]) for d in runs])
    first = runs[0]
    return {
        "tool": "ddl-perf", "kind": "scale", "version": 1,
        "model": first["model"], "describe": first["describe"], "unit": first["unit"],
        "via": first["via"], "precision": first["precision"], "batch": first["batch"],
        "device": first["device"], "base_ranks": first["ranks"],
        "train_args": list(train_args),
        "points": [{"ranks": d["ranks"], "throughput": d["throughput"]["total"],
                    "per_rank": d["throughput"]["per_rank"], "efficiency": e,
                    "step_s": d["step_s"], "shares": d["shares"]}
                   for d, e in zip(runs, eff)],
        "runs": list(runs),
    }


def table(doc: dict) -> Any:
    from rich.table import Table

    unit = doc["unit"]
    t = Table(title=f"ddl-perf scale: {doc['describe']}, batch {doc['batch']} per rank, "
                    f"{doc['precision']}, via {doc['via']}, {doc['device']}",
              caption=f"efficiency = throughput_N / (N x throughput_{doc['base_ranks']}) "
                      f"x {doc['base_ranks']}; shares as in ddl-perf train")
    for name in ("ranks", "step ms", f"{unit}/s", f"{unit}/s per rank", "efficiency",
                 "compute %", "comm %", "input %"):
        t.add_column(name, justify="right")
    for p in doc["points"]:
        s = p["shares"]
        t.add_row(str(p["ranks"]), f"{p['step_s'] * 1e3:.2f}", f"{p['throughput']:.1f}",
                  f"{p['per_rank']:.1f}", f"{p['efficiency']:.1%}",
                  f"{100 * s['compute']:.1f}", f"{100 * s['comm']:.1f}",
                  f"{100 * s['input']:.1f}")
    return t


def same_threads(counts: Sequence[int], launch: Launch, environ: Mapping[str, str],
                 cores: int) -> dict[str, str] | None:
    """The env every job gets so that each compares like with like: one torch thread count
    per rank for all counts (this host's cores // the largest count, min 1), unless
    OMP_NUM_THREADS is set or the jobs run on other hosts (whose cores ddlrun knows)."""
    base = launch.env()
    if "OMP_NUM_THREADS" in environ or launch.hosts or launch.hostfile:
        return base
    return {**(base or environ), "OMP_NUM_THREADS": str(max(1, cores // max(counts)))}


def run_jobs(counts: Sequence[int], train_args: Sequence[str], timeout: float,
             console: Any, start: Callable[..., subprocess.Popen] = subprocess.Popen,
             launch: Launch = DDLRUN, env: Mapping[str, str] | None = None) -> list[dict]:
    """Each count's job in turn under a progress display; its train document back.
    ``start``: the process starter (a seam for tests). A failed job raises RuntimeError
    with its output's tail."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    docs = []
    with tempfile.TemporaryDirectory(prefix="ddl-perf-scale-") as tmp, Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
            TextColumn("{task.completed}/{task.total} jobs"), TimeElapsedColumn(),
            console=console, transient=True) as progress:
        task = progress.add_task("starting", total=len(counts))
        for n in counts:
            part = os.path.join(tmp, f"{n}.json")
            argv = job_argv(n, train_args, part, timeout, launch)
            progress.update(task, description=f"{launch.name()} -n {n} ddl-perf train")
            tail: list[str] = []

            def seen(line: str, n: int = n) -> None:
                nonlocal tail
                line = launch.clean(line)
                tail = [*tail[-40:], line.rstrip("\n")]
                if line.startswith("# total"):
                    progress.console.print(f"[{n} rank(s)] {line.strip()}", markup=False,
                                           highlight=False)

            code = stream(argv, timeout, seen, merge_stderr=True,
                          start=start if env is None else functools.partial(start, env=env))
            if code or not os.path.exists(part):
                raise RuntimeError(f"the {n}-rank job exited with {code}:\n" + "\n".join(tail))
            with open(part) as f:
                docs.append(json.load(f))
            progress.advance(task)
    return docs


def scale_main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .. import topology
    from . import plot

    if topology.world_from_env().size > 1:
        print("ddl-perf scale: it starts jobs of its own; run it outside a job (not under "
              "ddlrun or mpirun)", file=sys.stderr)
        return 2
    try:
        train.config_from_args(args)  # the flags checked before the first job starts
        launch = launch_from_args(args)
        launch.check()
    except ValueError as exc:
        print(f"ddl-perf scale: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            plot._figure_cls()  # fail before the jobs, not after
        except plot.PlotError as exc:
            print(f"ddl-perf scale: --plot: {exc}", file=sys.stderr)
            return 2
    train_args = train.train_argv(args)
    console = Console(width=None if sys.stdout.isatty() else 120)  # pipes: no 80 cut
    counts = sorted(dict.fromkeys(args.ranks))
    try:
        env = same_threads(counts, launch, os.environ, len(os.sched_getaffinity(0)))
        if env is not None and "OMP_NUM_THREADS" in env and "OMP_NUM_THREADS" not in os.environ:
            console.print(f"# every job: OMP_NUM_THREADS={env['OMP_NUM_THREADS']} (cores // "
                          f"{max(counts)} ranks), so each rank computes alike at every count; "
                          "set OMP_NUM_THREADS to choose", markup=False, highlight=False)
        runs = run_jobs(counts, train_args, args.timeout, console, launch=launch, env=env)
    except RuntimeError as exc:
        print(f"ddl-perf scale: {exc}", file=sys.stderr)
        return 1
    doc = scale_doc(runs, train_args)
    console.print(table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if args.plot:
        try:
            plot.render([(plot.SCALE, doc)], args.plot)
        except plot.PlotError as exc:
            print(f"ddl-perf scale: --plot: {exc}", file=sys.stderr)
            return 2
    return 0
