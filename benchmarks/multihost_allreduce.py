"""Allreduce across simulated hosts on a slow link: the proof that the DDL
multi-dimensional allreduce pays off (docs/performance.md).

Needs root: builds network namespaces (one per "host", each with its own hostname and
sshd; tests/launcher/netns_cluster.py), limits every host's link with
``tc ... tbf rate RATE burst 256kb latency 50ms`` in both directions, then runs, side by
side through ddlrun's ssh backend, benchmarks/allreduce_worker.py for:

  ddl-md    ddl, -mode b:<ranks per host>x<hosts>: shared memory inside, Gloo across
  ddl-flat  ddl, no grid: one flat ring over all ranks (Gloo point-to-point)
  gloo      torch.distributed.all_reduce (gloo), the same ranks
  mpi       Open MPI MPI_Allreduce through ddlrun --launcher mpirun (default coll and ^han)

    python benchmarks/multihost_allreduce.py --hosts 2 --per-host 2 --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "benchmarks" / "allreduce_worker.py")
MODE = "b"  # --mode: the letters ddl-md runs with
sys.path.insert(0, str(REPO / "tests" / "launcher"))
from allreduce_worker import Result, table  # noqa: E402
from netns_cluster import IFACE, Cluster, unavailable  # noqa: E402


def limit(cluster: Cluster, nhosts: int, rate: str, delay: str | None) -> None:
    for i in range(nhosts):
        for ns, dev in ((cluster.switch, f"p{i}"), (cluster.host_ns[i], IFACE)):
            argv = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root"]
            if delay:
                argv += ["netem", "delay", delay, "rate", rate]
            else:
                argv += ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
            subprocess.run(argv, check=True, capture_output=True)


def run(cluster: Cluster, engine: str, nhosts: int, per: int, sizes: str, reps: int,
        extra: list[str], env: list[str]) -> list[Result]:
    plugin = {"ddl-md": "ddl", "ddl-flat": "ddl", "mpi-noh": "mpi"}.get(engine, engine)
    opts = list(extra)
    if engine == "ddl-md":
        opts += ["--mode", f"{MODE}:{per}x{nhosts}", "--ddloption", "-dump_iter 20"]
    elif engine in ("ddl-flat", "gloo"):
        opts += ["--no_ddloptions"]
    if engine.startswith("mpi"):
        opts += ["--launcher", "mpirun", "--tcp"]
        if engine == "mpi-noh":
            opts += ["--mpiarg", "--mca coll ^han"]
    for e in env:
        opts += ["-x", e]
    argv = cluster.in_launcher([
        sys.executable, "-m", "ddlrun", *cluster.ddlrun_opts(), "-H",
        cluster.hosts(nhosts, per), *opts,
        sys.executable, WORKER, "--engine", plugin, "--sizes", sizes,
        "--reps", str(reps), "--target-seconds", "1.0"])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=str(REPO))
    if res.returncode != 0:
        print(f"# {engine}: exit {res.returncode}\n{res.stderr[-2500:]}", file=sys.stderr)
        return []
    dumps = [ln for ln in res.stderr.splitlines() if "[ddl] allreduce" in ln]
    if dumps:
        print(f"# {engine} per-dimension time (-dump_iter, rank 0): {dumps[-1]}")
    out = []
    for m in re.finditer(r"^(?:\[[\d,]+\](?:<stdout>)?:? ?)?(\{.*\})$", res.stdout, re.M):
        d = json.loads(m.group(1))
        out.append(Result(engine, d["ranks"], d["bytes"], d["median"], tuple(d["times"]),
                          d["correct"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--delay", default=None, help="use netem with this delay, e.g. 1ms")
    ap.add_argument("--sizes", default="4M,16M,64M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engines", default="ddl-md,ddl-flat,gloo,mpi,mpi-noh")
    ap.add_argument("--json")
    ap.add_argument("--env", action="append", default=[], help="KEY=VAL for every rank")
    ap.add_argument("--mode", default="b", help="DDL mode letters for ddl-md (r, n, b, p)")
    a = ap.parse_args()
    global MODE
    MODE = a.mode
    why = unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    from ddl.perf.sizes import size_list

    sizes = ",".join(str(s) for s in size_list(a.sizes))
    engines = a.engines.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp), nhosts=a.hosts)
        try:
            cluster.start()
            limit(cluster, a.hosts, a.rate, a.delay)
            link = f"netem {a.delay} rate {a.rate}" if a.delay else f"tbf rate {a.rate}"
            print(f"# {a.hosts} hosts x {a.per_host} ranks, every host link {link} "
                  "burst 256kb latency 50ms (both directions); float32 sum in place")
            results = []
            for e in engines:
                results += run(cluster, e, a.hosts, a.per_host, sizes, a.reps, [],
                               ["OMP_NUM_THREADS=1", *a.env])
        finally:
            cluster.close()
    print(table(results, engines, markdown=True, ours=("ddl-md",)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)
    return 0 if results and all(r.correct for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
