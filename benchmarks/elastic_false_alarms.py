"""How low can the detection timeout go? False alarms of ``DDL_TIMEOUT`` in elastic jobs
under full CPU load (docs/performance.md)::

    python benchmarks/elastic_false_alarms.py [--runs 100] [--timeouts 2,1] [--load 4]

Needs root (simulated hosts: network namespaces with sshd, tests/launcher/netns_cluster.py).
ddl's collectives raise ``DDLTimeoutError`` when a peer does not arrive within
``DDL_TIMEOUT`` seconds; in an elastic job that counts as a lost peer, so a timeout that
fires although every worker is alive is a false alarm that re-forms the world (or waits for
one) for nothing. Each run is a short elastic job on 2 hosts x 2 ranks that loses nobody:
``ddlrun -H h1:2,h2:2 -np 4 --min-np 2 --max-np 4 -x DDL_TIMEOUT=T
benchmarks/elastic_worker.py inplace STAMPS --params 262144 --steps 30 --commit 5
--kill-step 0`` (30 allreduces of 1 MB, a commit every 5 steps), while ``--load`` busy-loop
processes (default twice the cores) keep every core busy for the whole measurement.

A run is a false alarm when anything of a lost peer shows: ddlrun's "re-forming the world"
line, a ``DDLTimeoutError`` or "a peer was lost" in the output, a step stamped in a
re-formed world, a non-zero exit, or no finish within ``--run-timeout``; "in ddl.init()"
marks one that struck while the first world formed (``DDL_TIMEOUT`` also bounds the
engine's group check-in there), before ``@elastic.run`` could catch it. The runs of the
timeouts alternate (round robin) so load drifts fall on each alike. ``--elastic-timeout``
(short by default) bounds how long a worker that timed out waits for a next world that
ddlrun, having lost no one, may never form.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "benchmarks" / "elastic_worker.py")
HOSTS, PER_HOST = 2, 2
SIGNS = ("re-forming the world", "DDLTimeoutError", "a peer was lost")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="runs per timeout (default 100)")
    parser.add_argument("--timeouts", default="2",
                        help="DDL_TIMEOUT values in seconds, comma-separated (default 2)")
    parser.add_argument("--load", type=int, default=2 * (os.cpu_count() or 1),
                        help="busy-loop processes for the whole measurement (default 2x cores)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--commit", type=int, default=5, help="commit every N steps")
    parser.add_argument("--params", type=int, default=1 << 18,
                        help="float32 elements allreduced per step (default 262144: 1 MB)")
    parser.add_argument("--elastic-timeout", type=float, default=20.0,
                        help="ddlrun --elastic-timeout of each run (default 20)")
    parser.add_argument("--run-timeout", type=float, default=180.0,
                        help="seconds a run may take before it counts as hung (default 180)")
    parser.add_argument("--json", help="also write every run to this file")
    return parser


@dataclass
class Outcome:
    """One run: its timeout, wall time, and why it is a false alarm (empty: it is not)."""

    timeout: float
    seconds: float
    alarm: list[str] = field(default_factory=list)
    excerpt: str = ""


def busy_loops(count: int) -> list[subprocess.Popen]:
    """``count`` processes that spin on a core until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()


def job_argv(cluster: Any, args: argparse.Namespace, timeout: float, stamps: str) -> list[str]:
    n = HOSTS * PER_HOST
    return cluster.in_launcher([
        sys.executable, "-m", "ddlrun", *cluster.ddlrun_opts(),
        "-H", cluster.hosts(HOSTS, PER_HOST), "-np", str(n), "--min-np", str(PER_HOST),
        "--max-np", str(n), "--elastic-timeout", f"{args.elastic_timeout:g}",
        "-x", f"DDL_TIMEOUT={timeout:g}",
        sys.executable, WORKER, "inplace", stamps, "--params", str(args.params),
        "--steps", str(args.steps), "--commit", str(args.commit), "--kill-step", "0"])


def judge(code: int | None, output: str, folder: str, steps: int) -> list[str]:
    """Why this run shows a lost peer although none was lost (empty: a clean run)."""
    why = [sign for sign in SIGNS if sign in output]
    if "    ddl.init()" in output:  # a traceback through init: the world never began
        why.append("in ddl.init()")
    if code is None:
        why.append("hung")
    elif code != 0:
        why.append(f"exit {code}")
    finals = []
    for path in glob.glob(os.path.join(folder, "stamps.*")):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if any(r.get("world", 0) > 0 for r in rows):
            why.append("re-formed world")
        done = [r for r in rows if "step" in r]
        finals.append(done[-1]["step"] if done else 0)
    if code == 0 and finals != [steps] * (HOSTS * PER_HOST):
        why.append(f"steps reached {sorted(finals)}")
    return sorted(set(why))


def one_run(cluster: Any, args: argparse.Namespace, timeout: float) -> Outcome:
    folder = tempfile.mkdtemp(prefix="elastic_false_alarms.")
    try:
        t0 = time.monotonic()
        try:
            proc = subprocess.run(job_argv(cluster, args, timeout, os.path.join(folder, "stamps")),
                                  capture_output=True, text=True, timeout=args.run_timeout,
                                  cwd=folder, env={**os.environ, "OMP_NUM_THREADS": "1"})
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code = None
            output = "".join(o.decode(errors="replace") if isinstance(o, bytes) else (o or "")
                             for o in (exc.stdout, exc.stderr))
        seconds = time.monotonic() - t0
        why = judge(code, output, folder, args.steps)
        lines = [ln for ln in output.splitlines()
                 if any(s in ln for s in (*SIGNS, "Error", "ddlrun:"))]
        return Outcome(timeout, seconds, why, "\n".join(lines[-6:]) if why else "")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def table(outcomes: list[Outcome], timeouts: list[float]) -> list[str]:
    lines = ["| DDL_TIMEOUT | runs | false alarms | rate | run time median (min - max) |",
             "|---|---|---|---|---|"]
    for t in timeouts:
        mine = [o for o in outcomes if o.timeout == t]
        if not mine:
            continue
        alarms = sum(1 for o in mine if o.alarm)
        times = [o.seconds for o in mine]
        lines.append(f"| {t:g} s | {len(mine)} | {alarms} | {alarms / len(mine):.0%} | "
                     f"{statistics.median(times):.1f} s ({min(times):.1f} - {max(times):.1f}) |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sys.path.insert(0, str(REPO / "tests" / "launcher"))
    from netns_cluster import Cluster, unavailable

    why = unavailable()
    if why:
        print(f"elastic_false_alarms.py: {why}", file=sys.stderr)
        return 2
    timeouts = [float(t) for t in args.timeouts.split(",") if t.strip()]
    outcomes: list[Outcome] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elastic_false_alarms.") as tmp:
        cluster = Cluster(Path(tmp), nhosts=HOSTS)
        load: list[subprocess.Popen] = []
        try:
            cluster.start()
            load = busy_loops(args.load)
            for number in range(args.runs):
                for t in timeouts:
                    outcomes.append(one_run(cluster, args, t))
                    o = outcomes[-1]
                    print(f"# run {number + 1} DDL_TIMEOUT={t:g}: {o.seconds:.1f} s "
                          f"{'; '.join(o.alarm) or 'clean'}", file=sys.stderr, flush=True)
        finally:
            stop(load)
            cluster.close()
    total = time.monotonic() - started
    command = ("python benchmarks/elastic_false_alarms.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)).strip()
    out = [f"`{command}` ({os.cpu_count()} CPUs, {args.load} busy-loop processes on them "
           f"throughout; {total / 60:.1f} min in all)", "",
           f"Each run: `ddlrun -H h1:2,h2:2 -np 4 --min-np 2 --max-np 4 --elastic-timeout "
           f"{args.elastic_timeout:g} -x DDL_TIMEOUT=T python benchmarks/elastic_worker.py "
           f"inplace STAMPS --params {args.params} --steps {args.steps} --commit {args.commit} "
           f"--kill-step 0` ({args.steps} allreduces of {args.params * 4 / 2**20:g} MB, "
           "no worker lost): a false alarm is any sign of a lost peer.", ""]
    out += table(outcomes, timeouts)
    alarms = [o for o in outcomes if o.alarm]
    if alarms:
        out += ["", "False alarms (first 3):", ""]
        for o in alarms[:3]:
            out += [f"- DDL_TIMEOUT={o.timeout:g}, {o.seconds:.1f} s: {', '.join(o.alarm)}",
                    "", "  ```", *[f"  {ln}" for ln in o.excerpt.splitlines()], "  ```"]
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([o.__dict__ for o in outcomes], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
