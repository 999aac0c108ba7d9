"""Run benchmarks/identity_fold/bench_ab.py ROUNDS times on 2 local ranks; medians over rounds.

    .venv/bin/python benchmarks/identity_fold/bench_ab_drive.py ROUNDS REPS [cpu]
"""
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
from procs import run_workers  # noqa: E402

rounds, reps = int(sys.argv[1]), sys.argv[2]
extra = sys.argv[3:]  # "cpu": CPU time under DDL_SHM_WAIT=futex
env = {"DDL_SHM_WAIT": "futex"} if "cpu" in extra else None
runs = []
for _ in range(rounds):
    res = run_workers(os.path.join(HERE, "bench_ab.py"), 2, reps, *extra, env=env, timeout=900)
    line = [ln for r in res for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    if not line:
        for r in res:
            print(r.rank, r.returncode, r.stdout[-1500:], r.stderr[-3000:])
        sys.exit(1)
    runs.append(json.loads(line[0][7:]))
print(f"# {rounds} rounds x {reps} reps (64 MiB: reps//50), interleaved call by call; "
      "median over rounds of each round's median, us")
for size in runs[0]:
    keys = runs[0][size].keys()
    print(size, {k: round(statistics.median(r[size][k] for r in runs), 3) for k in keys})
print(json.dumps(runs))
