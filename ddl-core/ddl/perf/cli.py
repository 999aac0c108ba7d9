"""``ddl-perf``: measure collectives (see docs/performance.md) and training throughput
(train, scale, plot: docs/perf-tools.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

from .. import config, topology
from .ddlrun_job import add_launch_arguments
from .sizes import size_arg as _size

COLLECTIVE_HELP = {
    "allreduce": "allreduce time and busbw (nccl-tests' all_reduce_perf)",
    "allgather": "allgather (all_gather_perf)",
    "broadcast": "broadcast (broadcast_perf)",
    "reduce_scatter": "reduce_scatter (reduce_scatter_perf)",
    "alltoall": "alltoall (alltoall_perf)",
}
ENGINE_CHOICES = {  # --engine: what ddl runs, through the variables ddl.init reads
    "auto": {}, "gloo": {"DDL_TRANSPORT": "gloo"}, "mpi": {"DDL_TRANSPORT": "mpi"},
    "nccl": {"DDL_DEVICE_ENGINE": "nccl"}, "host": {"DDL_DEVICE_ENGINE": "host"},
}


_ROLE = re.compile(r":[a-z]+:`([^`]*)`")  # :func:`x` and co


def plain(text: str) -> str:
    """A docstring as ``--help`` prints it: reStructuredText's roles, literal quotes and
    literal-block colons (``text::``) dropped, the words kept."""
    text = _ROLE.sub(r"\1", text).replace("`", "")
    return re.sub(r"::$", ":", text, flags=re.MULTILINE)


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",") if r]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"--ranks {text!r}: give rank counts, e.g. 2,4")
    return ranks


def _add_collective(sub: argparse._SubParsersAction, name: str) -> None:
    c = sub.add_parser(
        name, help=COLLECTIVE_HELP[name],
        description=f"{COLLECTIVE_HELP[name]}: nccl-tests' flags and table. Inside a job "
                    f"(ddlrun -n 4 ddl-perf {name} ...) every rank measures and rank 0 "
                    "prints; outside one, --ranks starts such jobs (else: one rank).")
    c.add_argument("-b", "--minbytes", type=_size, default=32 << 20, metavar="BYTES",
                   help="smallest size, K/M/G suffixes (default 32M)")
    c.add_argument("-e", "--maxbytes", type=_size, default=32 << 20, metavar="BYTES",
                   help="largest size (default 32M)")
    c.add_argument("-i", "--stepbytes", type=_size, default=1 << 20, metavar="BYTES",
                   help="add this many bytes between sizes when -f is 1 (default 1M)")
    c.add_argument("-f", "--stepfactor", type=int, default=1, metavar="N",
                   help="multiply the size by N between sizes (default 1: use -i)")
    c.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (20)")
    c.add_argument("-w", "--warmup_iters", type=int, default=5,
                   help="warm-up iterations at the largest and smallest size (5)")
    c.add_argument("-c", "--check", type=int, default=1, metavar="N",
                   help="check the result N times per measurement, counting wrong "
                        "elements over all ranks (default 1; 0: no check)")
    c.add_argument("-d", "--datatype", default="float",
                   help="int8 uint8 int32 uint32 int64 uint64 half float double bfloat16")
    c.add_argument("-o", "--op", default="sum", choices=("sum", "prod", "max", "min", "avg"),
                   help="reduction (allreduce, reduce_scatter)")
    c.add_argument("-r", "--root", type=int, default=0, help="broadcast root (0)")
    c.add_argument("-g", "--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the buffers live: host memory, or this rank's GPU")
    c.add_argument("--compare", default="", metavar="ENGINES",
                   help="peers measured side by side in the same job, ratios to ddl: "
                        "ddl-heap (ddl.malloc buffers), ddl-torch (torch CPU tensors), "
                        "gloo, nccl (torch.distributed), mpi (mpi4py; the job must come "
                        "from mpirun), horovod")
    c.add_argument("--engine", default="auto", choices=sorted(ENGINE_CHOICES),
                   help="what ddl runs: gloo/mpi across hosts (DDL_TRANSPORT), nccl/host "
                        "for GPU tensors (DDL_DEVICE_ENGINE); auto: ddl's choice")
    c.add_argument("--mode", metavar="MODE",
                   help="ddl's -mode (r, n, b, p, or a grid such as b:2x2) in DDL_OPTIONS")
    c.add_argument("--ranks", type=_ranks, metavar="N,N",
                   help="outside a job: run one ddlrun job per rank count (e.g. 2,4)")
    c.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    c.add_argument("--roofline", default="auto", choices=("auto", "fresh", "off"),
                   help="the host memory bandwidth each row is compared with: auto (cached "
                        "per host, measured once), fresh (measured again), off")
    c.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds a --ranks job may take (default 1800)")
    add_launch_arguments(c)


def _add_training(sub: argparse._SubParsersAction) -> None:
    """train, scale, plot (docs/perf-tools.md)."""
    from . import train

    t = sub.add_parser("train", help="training throughput (images or tokens/s) and where "
                                     "a step's time goes",
                       description="Synthetic or --data training throughput of a standard "
                                   "model through ddl or a peer; inside a job every rank "
                                   "trains and rank 0 prints (docs/perf-tools.md).")
    train.add_train_arguments(t)
    s = sub.add_parser("scale", help="train at 1, 2, 4, ... ranks: throughput and scaling "
                                     "efficiency",
                       description="One ddlrun job of ddl-perf train per --ranks count; "
                                   "efficiency = throughput_N / (N x throughput_1).")
    s.add_argument("--ranks", type=_ranks, default=[1, 2], metavar="N,N",
                   help="rank counts, one ddlrun job each (default 1,2)")
    s.add_argument("--json", metavar="PATH", help="also write the points as JSON")
    s.add_argument("--plot", metavar="FILE.png", help="also draw throughput vs ranks, with "
                                                      "the ideal line (matplotlib)")
    s.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds one job may take (default 1800)")
    add_launch_arguments(s)
    train.add_train_arguments(s, json_flag=False)
    pl = sub.add_parser("plot", help="draw allreduce --json (busbw vs size), scale --json "
                                     "(throughput vs ranks), simulate --json against measured "
                                     "allreduce times, and calibrate profiles (fit vs measured)",
                        description="Each file's kind is read from it: ddl-perf allreduce "
                                    "& co --json, ddl-perf scale --json, ddl-perf simulate "
                                    "--grid --json, or a ddl-perf calibrate profile. One "
                                    "panel per kind.")
    pl.add_argument("results", nargs="+", metavar="RESULTS.json")
    pl.add_argument("-o", "--output", required=True, metavar="OUT.png|OUT.svg")
    pl.add_argument("--in-place", action="store_true",
                    help="collectives: plot the in-place busbw (default: out of place)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddl-perf", description=plain(__doc__))
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in COLLECTIVE_HELP:
        _add_collective(sub, name)
    from . import calibrate, simulate

    sm = sub.add_parser("simulate", help="predict allreduce time and training scaling "
                                         "(cost model, presets)",
                        description=plain(simulate.__doc__.split("\n\n")[0]))
    simulate.add_arguments(sm)
    cal = sub.add_parser("calibrate", help="measure alpha and beta per grid dimension: a "
                                           "cost profile for DDL_COST_PROFILE",
                         description="Inside a job (ddlrun -n 4 ddl-perf calibrate -o "
                                     "profile.json): time each grid dimension's allreduce "
                                     "and fit the cost model's latency and bandwidth.")
    calibrate.add_arguments(cal)
    _add_training(sub)
    from . import gpu_check

    g = sub.add_parser("gpu-check", help="prove the GPU path in one run: NCCL engine, busbw "
                                         "next to torch's NCCL, DDP, ResNet-50 (a report)",
                       description=plain(gpu_check.__doc__.split("\n\n")[0]))
    gpu_check.add_arguments(g)
    e = sub.add_parser("env", help="list the environment variables ddl reads")
    e.add_argument("--markdown", action="store_true", help="as the table in docs/tuning.md")
    return p


def _engines(args: argparse.Namespace) -> list[str]:
    """ddl first (unless the list names one of ddl's own), then the peers."""
    from .allreduce import OURS

    names = list(dict.fromkeys(e for e in args.compare.split(",") if e))
    if not any(n in OURS for n in names):
        names.insert(0, "ddl")
    return names


def _config(args: argparse.Namespace, p: argparse.ArgumentParser):
    from . import allreduce as ar

    try:
        dtype = ar.parse_dtype(args.datatype)
        sizes = ar.sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    except ValueError as exc:
        p.error(str(exc))
    for flag, value, low in (("-n", args.iters, 1), ("-w", args.warmup_iters, 0),
                             ("-c", args.check, 0)):
        if value < low:
            p.error(f"{flag} {value}: must be >= {low}")
    reduces = ar.COLLECTIVES[args.cmd].reduces
    return ar.Config(
        collective=args.cmd, sizes=tuple(sizes), iters=args.iters, warmup=args.warmup_iters,
        check=args.check, dtype=dtype, op=args.op if reduces else "sum", root=args.root,
        device=args.device, engines=tuple(_engines(args)), factor=args.stepfactor,
        step=args.stepbytes, json_path=args.json, argv=tuple(sys.argv),
        min_bytes=args.minbytes, max_bytes=args.maxbytes, roofline=args.roofline)


def _forward(args: argparse.Namespace, json_path: str | None) -> list[str]:
    """The flags of this run for the ranks of a --ranks job (argv, never a shell line)."""
    argv = [args.cmd, "-b", str(args.minbytes), "-e", str(args.maxbytes), "-i",
            str(args.stepbytes), "-f", str(args.stepfactor), "-n", str(args.iters), "-w",
            str(args.warmup_iters), "-c", str(args.check), "-d", args.datatype, "-o",
            args.op, "-r", str(args.root), "-g", args.device, "--engine", args.engine,
            "--roofline", args.roofline]
    if args.compare:
        argv += ["--compare", args.compare]
    if args.mode:
        argv += ["--mode", args.mode]
    if json_path:
        argv += ["--json", json_path]
    return argv


def _spawn(args: argparse.Namespace) -> int:
    """One ddlrun job per --ranks count, its rows streamed as rank 0 prints them; mpirun
    launches the job when mpi is compared, so MPI_COMM_WORLD is the job, and Horovod's
    horovodrun when horovod is, so Horovod has its rendezvous."""
    import functools
    import subprocess
    import tempfile

    from .ddlrun_job import launch_from_args, stream

    launch = launch_from_args(args)
    try:
        if "mpi" in _engines(args) and launch.horovod:
            raise ValueError("--compare mpi and horovod cannot share a job: MPI's needs "
                             "mpirun's, Horovod's horovodrun's; compare them in two runs")
        launch.check()
    except ValueError as exc:
        print(f"ddl-perf: {exc}", file=sys.stderr)
        return 2
    if "mpi" in _engines(args):
        launch = dataclasses.replace(launch, extra=("--launcher", "mpirun", *launch.extra))
    worst, docs = 0, []
    with tempfile.TemporaryDirectory(prefix="ddl-perf-") as tmp:
        for n in args.ranks:
            part = os.path.join(tmp, f"{n}.json") if args.json else None
            argv = launch.argv(n, _forward(args, part), args.timeout)
            count = ["-np" if launch.horovod else "-n", str(n)]
            shown = [launch.name(), *count, *launch.where(), *launch.extra]
            print(f"# {' '.join(shown)} ddl-perf {' '.join(_forward(args, None))}", flush=True)
            env = launch.env()
            code = stream(argv, args.timeout,
                          lambda line: print(launch.clean(line), end="", flush=True),
                          start=(subprocess.Popen if env is None
                                 else functools.partial(subprocess.Popen, env=env)))
            if code:
                print(f"# ddl-perf: the {n}-rank job exited with {code}", file=sys.stderr)
            worst = max(worst, abs(code))
            if part and os.path.exists(part):
                with open(part) as f:
                    docs.append(json.load(f))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(docs[0] if len(docs) == 1 else docs, f, indent=1)
            f.write("\n")
    return worst


def _ddl_env(args: argparse.Namespace) -> None:
    """--mode and --engine become the variables ddl.init reads (this process only)."""
    from .. import options

    os.environ.update(ENGINE_CHOICES[args.engine])
    if args.mode:
        mode, grid = options.parse_mode(args.mode)
        opts = options.parse(config.get("DDL_OPTIONS"))
        os.environ["DDL_OPTIONS"] = dataclasses.replace(opts, mode=mode, grid=grid).to_string()
    if "WORLD_SIZE" not in os.environ and topology.world_from_env().size == 1:
        # one rank of our own: torch's groups still want a rendezvous address
        from ddlrun.preflight import pick_free_pair

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(pick_free_pair()))


def _collective(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from .. import DDLError
    from . import allreduce as ar
    from . import worker

    cfg = _config(args, p)
    if args.ranks:
        if topology.world_from_env().size > 1:
            p.error("--ranks starts jobs of its own: inside a job (ddlrun, mpirun) the job's "
                    "ranks are measured; drop --ranks")
        return _spawn(args)
    try:
        _ddl_env(args)
        harness = worker.Harness()
    except DDLError as exc:
        print(f"ddl-perf: {exc}", file=sys.stderr)
        return 2
    engines: list = []
    try:
        if not 0 <= cfg.root < harness.size:
            raise worker.Unavailable(f"-r {cfg.root}: the root must be in 0..{harness.size - 1}")
        engines = worker.make_engines(list(cfg.engines), harness.rank, harness.size,
                                      cfg.device, cfg.collective, cfg.dtype, cfg.op)
        return ar.run_job(cfg, engines, harness)
    except (worker.Unavailable, DDLError) as exc:
        if harness.rank == 0:
            print(f"ddl-perf: {exc}", file=sys.stderr)
        return 2
    finally:
        for engine in reversed(engines):
            engine.close()
        harness.close()


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # `ddl-perf env | head`: the reader left; say nothing more (Python's documented way)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.cmd in COLLECTIVE_HELP:
        return _collective(args, p)
    if args.cmd == "simulate":
        from .simulate import simulate_main

        return simulate_main(args)
    if args.cmd == "calibrate":
        from .calibrate import calibrate_main

        return calibrate_main(args)
    if args.cmd == "train":
        from .train import train_main

        return train_main(args)
    if args.cmd == "scale":
        from .scale import scale_main

        return scale_main(args)
    if args.cmd == "gpu-check":
        from .gpu_check import gpu_check_main

        return gpu_check_main(args)
    if args.cmd == "plot":
        from .plot import plot_main

        return plot_main(args)
    if args.markdown:
        print(config.markdown())
        return 0
    for row in config.describe():
        allowed = f" allowed={row.allowed}" if row.allowed else ""
        print(f"{row.name:22} default={row.default:10} {row.doc}{allowed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
