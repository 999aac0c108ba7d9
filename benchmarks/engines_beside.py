"""Gloo beside MPI on one dimension across hosts: ddl under mpirun with MPI alone against
MPI and Gloo together (docs/performance.md, "Two engines on one dimension").

Needs root: the hosts are network namespaces with a tc-limited link
(``benchmarks/multihost_allreduce.py``'s cluster and worker). Every variant runs
``benchmarks/allreduce_worker.py --engine ddl`` through ``ddlrun --launcher mpirun --tcp``:

  ddl-mpi        DDL_TRANSPORT=mpi, DDL_GLOO_BESIDE_MPI=0: MPI alone across hosts
  ddl-mpi+gloo   DDL_TRANSPORT=mpi, DDL_GLOO_BESIDE_MPI=1: Gloo's allreduce a candidate too
  ddl-gloo       DDL_TRANSPORT=gloo: Gloo alone (under mpirun all the same)
  gloo, mpi      the engines' own allreduce, for reference

With ``--mode b`` the job first runs ``ddl-perf calibrate`` under mpirun (which times Gloo
beside MPI) and every ddl variant prices its algorithms from that profile::

    python benchmarks/engines_beside.py --hosts 2 --per-host 1 --mode p
    python benchmarks/engines_beside.py --mode b --engines ddl-mpi,ddl-mpi+gloo
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests" / "launcher"))
import multihost_allreduce as bench  # noqa: E402
from allreduce_worker import Result, table  # noqa: E402
from netns_cluster import Cluster, unavailable  # noqa: E402

VARIANTS = {
    "ddl-mpi": ["DDL_TRANSPORT=mpi", "DDL_GLOO_BESIDE_MPI=0"],
    "ddl-mpi+gloo": ["DDL_TRANSPORT=mpi", "DDL_GLOO_BESIDE_MPI=1"],
    "ddl-gloo": ["DDL_TRANSPORT=gloo"],
}
MPIRUN = ["--launcher", "mpirun", "--tcp"]


def calibrate(cluster: Cluster, nhosts: int, per: int, mode: str, out: Path) -> None:
    argv = cluster.in_launcher([
        sys.executable, "-m", "ddlrun", *cluster.ddlrun_opts(), "-H", cluster.hosts(nhosts, per),
        *MPIRUN, "--mode", f"{mode}:{per}x{nhosts}", "-x", "OMP_NUM_THREADS=1",
        sys.executable, "-m", "ddl.perf.cli", "calibrate", "-o", str(out),
        "--sizes", "4K,64K,1M,4M,16M"])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=str(REPO))
    if res.returncode != 0:
        raise SystemExit(f"calibrate failed ({res.returncode}):\n{res.stderr[-3000:]}")
    # rank 0's report, without mpirun's "[1,0]<stdout>:" tags
    print("\n".join(ln.split(">:", 1)[-1] for ln in res.stdout.splitlines() if ln.strip()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=1)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--sizes", default="4K,64K,1M,16M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mode", default="p", choices=("b", "p"))
    ap.add_argument("--engines", default="ddl-mpi,ddl-mpi+gloo,ddl-gloo,gloo,mpi")
    a = ap.parse_args()
    why = unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    from ddl.perf.sizes import size_list

    sizes = ",".join(str(s) for s in size_list(a.sizes))
    engines = a.engines.split(",")
    bench.MODE = a.mode
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp), nhosts=a.hosts)
        try:
            cluster.start()
            bench.limit(cluster, a.hosts, a.rate, None)
            env = ["OMP_NUM_THREADS=1"]
            if a.mode == "b":
                profile = Path(tmp) / "profile.json"
                calibrate(cluster, a.hosts, a.per_host, a.mode, profile)
                env.append(f"DDL_COST_PROFILE={profile}")
            print(f"# {a.hosts} hosts x {a.per_host} ranks, every host link tbf rate {a.rate}; "
                  f"ddl with -mode {a.mode}; float32 sum in place")
            for e in engines:
                if e in VARIANTS:
                    rows = bench.run(cluster, "ddl-md", a.hosts, a.per_host, sizes, a.reps,
                                     MPIRUN, [*env, *VARIANTS[e]])
                else:  # the engines' own: mpi adds the mpirun launcher itself
                    rows = bench.run(cluster, e, a.hosts, a.per_host, sizes, a.reps,
                                     [] if e == "mpi" else MPIRUN, env)
                results += [Result(e, r.ranks, r.nbytes, r.median, r.times, r.correct)
                            for r in rows]
        finally:
            cluster.close()
    ours = "ddl-mpi+gloo" if "ddl-mpi+gloo" in engines else engines[0]
    print(table(results, engines, markdown=True, ours=(ours,)))
    return 0 if results and all(r.correct for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
