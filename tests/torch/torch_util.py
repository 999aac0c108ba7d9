"""Run torch worker scripts as N local ranks, or through ddlrun, and read their reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ddl.perf.spawn import RankResult, run_local

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLES = os.path.join(ROOT, "examples")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run_worker(name: str, n: int, *args: str, env: dict | None = None,
               timeout: float = 180) -> list[RankResult]:
    return run_local(n, [os.path.join(WORKERS, name), *args], env={**ENV, **(env or {})},
                     timeout=timeout)


def reports(results: list[RankResult], check_rc: bool = True) -> list[dict]:
    """The last JSON line each rank printed; fails with every rank's output otherwise."""
    out = []
    for r in results:
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if (check_rc and r.returncode != 0) or not lines:
            detail = "\n".join(f"--- rank {x.rank} exit {x.returncode}\n{x.stdout[-2000:]}\n"
                               f"{x.stderr[-4000:]}" for x in results)
            raise AssertionError(f"rank {r.rank} failed:\n{detail}")
        out.append(json.loads(lines[-1]))
    return out


def ddlrun(n: int, argv: list[str], timeout: float = 180,
           env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ddlrun", "-n", str(n), sys.executable, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ENV, **(env or {})})
