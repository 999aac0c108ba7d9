"""``make demo``: the training job through ddlrun on 1 then 2 ranks, with the scaling
efficiency (throughput at N ranks / (N x throughput at 1 rank))."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(ranks: int, steps: int, out: str) -> dict:
    cmd = [sys.executable, "-m", "ddlrun", "-n", str(ranks), sys.executable,
           os.path.join(HERE, "train_numpy.py"), "--steps", str(steps), "--json", out]
    print(f"\n$ {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(out) as f:
        return json.load(f)


def main() -> int:
    ranks = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,2").split(",")]
    steps = int(os.environ.get("DEMO_STEPS", "600"))
    with tempfile.TemporaryDirectory() as tmp:
        res = [run(n, steps, os.path.join(tmp, f"r{n}.json")) for n in ranks]
    base = res[0]["samples_per_s"] / res[0]["ranks"]
    print("\n ranks   samples/s   per rank   scaling efficiency   accuracy")
    for r in res:
        eff = r["samples_per_s"] / (r["ranks"] * base)
        rate = r["samples_per_s"]
        print(f" {r['ranks']:5d}   {rate:9,.0f}   {rate / r['ranks']:8,.0f}"
              f"   {100 * eff:17.1f}%   {r['accuracy']:.3f}")
    cores = os.cpu_count() or 1
    if max(ranks) > cores:
        print(f"(this machine has {cores} cores: ranks beyond that share them)")
    return 0 if all(r["identical"] for r in res) else 1


if __name__ == "__main__":
    raise SystemExit(main())
