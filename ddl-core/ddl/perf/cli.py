"""``ddl-perf``: measure collectives (see docs/performance.md)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from .. import config


def _sizes(text: str) -> list[int]:
    return [config._size(s) for s in text.split(",") if s]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddl-perf", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("allreduce", help="allreduce time and busbw, ddl beside gloo and MPI")
    a.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    a.add_argument("--sizes", default="1K,64K,1M,16M,64M", help="message sizes in bytes")
    a.add_argument("--compare", default="ddl,ddl-heap,gloo,mpi",
                   help="engines: ddl (copy semantics), ddl-heap (ddl.malloc buffers), gloo "
                        "(torch.distributed), mpi (Open MPI via mpi4py)")
    a.add_argument("--reps", type=int, default=5, help="timed repetitions per size (median)")
    a.add_argument("--rounds", type=int, default=1,
                   help="run the whole comparison this many times, interleaved; report medians")
    a.add_argument("--target-seconds", type=float, default=0.2,
                   help="aim each repetition at this long (sets iterations)")
    a.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    a.add_argument("--markdown", action="store_true", help="print a Markdown table")
    sm = sub.add_parser("simulate", help="predict allreduce time on a grid (cost model)")
    sm.add_argument("--grid", default="4x16x4", help="ranks per host x hosts per rack x racks")
    sm.add_argument("--sizes", default="1M,16M,100M,1G")
    sm.add_argument("--links", default="shm,10e-6,5e9;net,50e-6,12.5e9;net,50e-6,12.5e9",
                    help="per dimension: name,alpha seconds,bytes/s (';'-separated); "
                         "default: shared memory, then 100 Gb/s links")
    sm.add_argument("--chunks", type=int, default=16, help="pipeline chunks")
    e = sub.add_parser("env", help="list the environment variables ddl reads")
    e.add_argument("--markdown", action="store_true", help="as the table in docs/tuning.md")
    return p


def _allreduce(args) -> int:
    from . import allreduce as ar

    engines = [e for e in args.compare.split(",") if e]
    unknown = set(engines) - set(ar.ENGINES)
    if unknown:
        print(f"ddl-perf: unknown engine(s) {sorted(unknown)}; use {ar.ENGINES}", file=sys.stderr)
        return 2
    ranks = [int(r) for r in args.ranks.split(",")]
    sizes = _sizes(args.sizes)
    print(f"# ddl-perf allreduce  float32 sum in place  {platform.node()}  "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"# median of {args.reps} reps x {args.rounds} round(s); busbw = size/time x 2(n-1)/n "
          "(nccl-tests); ratios are peer time / ddl time (>1: ddl faster)", flush=True)
    runs: dict[tuple, list] = {}
    failed = 0
    for _ in range(args.rounds):
        for n in ranks:
            for e in engines:
                try:
                    for r in ar.run_engine(e, n, sizes, args.reps, args.target_seconds):
                        runs.setdefault((e, n, r.nbytes), []).append(r)
                except (RuntimeError, FileNotFoundError, TimeoutError) as exc:
                    failed += 1
                    print(f"# {e} x{n}: {exc}", file=sys.stderr)
    results = []
    for rs in runs.values():
        rs.sort(key=lambda r: r.median)
        results.append(rs[len(rs) // 2])
    print(ar.table(results, engines, args.markdown))
    wrong = [r for r in results if not r.correct]
    for r in wrong:
        print(f"# WRONG RESULT: {r.engine} x{r.ranks} {r.nbytes} B", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(engine=r.engine, ranks=r.ranks, bytes=r.nbytes, median_s=r.median,
                            busbw_GBps=r.busbw, times_s=list(r.times), correct=r.correct)
                       for r in results], f, indent=1)
    return 1 if wrong or failed else 0


def _simulate(args) -> int:
    from .. import cost

    dims = [int(d) for d in args.grid.split("x")]
    links = []
    for spec in args.links.split(";"):
        name, alpha, bw = spec.split(",")
        links.append((name, cost.Link(alpha=float(alpha), beta=1 / float(bw))))
    if len(links) < len(dims):
        links += [links[-1]] * (len(dims) - len(links))
    world = 1
    for d in dims:
        world *= d
    algs = [("shm" if name == "shm" else cost.best(["ring", "hd"], n, 1 << 20, link), n, link)
            for n, (name, link) in zip(dims, links)]
    slowest = max((link for _, link in links[: len(dims)]), key=lambda lk: lk.beta)
    print(f"# ddl-perf simulate: grid {args.grid} = {world} ranks; alpha-beta model (ddl/cost.py)")
    print(f"# {'size':>8} {'flat ring':>12} {'multi-dim':>12} {'pipelined':>12} {'gain':>6}")
    for nbytes in _sizes(args.sizes):
        flat = cost.allreduce_time("ring", world, nbytes, slowest)
        md = cost.multidim_time(algs, nbytes)
        pl = cost.pipelined_time(algs, nbytes, args.chunks)
        print(f"  {nbytes:>8} {flat * 1e3:>10.2f}ms {md * 1e3:>10.2f}ms {pl * 1e3:>10.2f}ms "
              f"{flat / pl:>5.1f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "allreduce":
        return _allreduce(args)
    if args.cmd == "simulate":
        return _simulate(args)
    if args.markdown:
        print("| variable | default | meaning |\n|---|---|---|")
        for name, default, doc in config.describe():
            print(f"| `{name}` | {default or '-'} | {doc} |")
        return 0
    for name, default, doc in config.describe():
        print(f"{name:22} default={default!s:10} {doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
