"""``make demo``: a PyTorch data-parallel training job (examples/train_torch.py: a small CNN,
Horovod-style DistributedOptimizer on ddl) through ddlrun on 1 then 2 ranks, with a progress
bar, per-rank and total throughput, and the scaling efficiency
(throughput at N ranks / (N x throughput at 1 rank)).

    python examples/demo.py 1,2          # DEMO_STEPS=300, DEMO_MODE=hvd|ddp
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
STEP = re.compile(r"step (\d+)/(\d+) loss ([0-9.]+)")
console = Console()


def run(ranks: int, steps: int, mode: str, out: str) -> dict:
    cmd = [sys.executable, "-m", "ddlrun", "-n", str(ranks), sys.executable,
           os.path.join(HERE, "train_torch.py"), "--steps", str(steps), "--mode", mode,
           "--json", out]
    console.print(f"\n[bold]$ ddlrun -n {ranks} python examples/train_torch.py "
                  f"--steps {steps} --mode {mode}[/bold]")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    tail: list[str] = []
    with Progress(TextColumn(f"{ranks} rank(s)"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task("train", total=steps, loss="-")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-20:]
            m = STEP.search(line)
            if m:
                bar.update(task, completed=int(m.group(1)), loss=m.group(3))
        rc = proc.wait()
    if rc != 0:
        console.print("\n".join(tail))
        raise SystemExit(f"the {ranks}-rank job failed with exit code {rc}")
    with open(out) as f:
        return json.load(f)


def main() -> int:
    ranks = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,2").split(",")]
    steps = int(os.environ.get("DEMO_STEPS", "300"))
    mode = os.environ.get("DEMO_MODE", "hvd")
    with tempfile.TemporaryDirectory() as tmp:
        res = [run(n, steps, mode, os.path.join(tmp, f"r{n}.json")) for n in ranks]
    base = res[0]["samples_per_s"] / res[0]["ranks"]
    table = Table(title=f"PyTorch CNN ({res[0]['params']:,} parameters), {mode}, "
                        f"{steps} steps of 64 images per rank")
    for col in ("ranks", "samples/s", "per rank", "scaling efficiency", "accuracy",
                "ranks identical"):
        table.add_column(col, justify="right")
    for r in res:
        eff = r["samples_per_s"] / (r["ranks"] * base)
        table.add_row(str(r["ranks"]), f"{r['samples_per_s']:,.0f}", f"{r['per_rank']:,.0f}",
                      f"{100 * eff:.1f}%", f"{r['accuracy']:.3f}", str(r["identical"]))
    console.print(table)
    cores = os.cpu_count() or 1
    if max(ranks) > cores:
        console.print(f"(this machine has {cores} cores: ranks beyond that share them)")
    return 0 if all(r["identical"] for r in res) else 1


if __name__ == "__main__":
    raise SystemExit(main())
