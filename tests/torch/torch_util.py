"""Run torch worker scripts as N local ranks, or through ddlrun, and read their reports
(tests/procs.py's runner, with this folder's workers and a quiet single-threaded env)."""

from __future__ import annotations

import os
import subprocess
import sys

from procs import RankResult, reports, run_ddlrun, run_workers  # noqa: F401 - re-exported

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLES = os.path.join(ROOT, "examples")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run_worker(name: str, n: int, *args: str, env: dict | None = None,
               timeout: float = 180, per_rank_env: list[dict] | None = None
               ) -> list[RankResult]:
    return run_workers(os.path.join(WORKERS, name), n, *args, env={**ENV, **(env or {})},
                       timeout=timeout, per_rank_env=per_rank_env)


def ddlrun(n: int, argv: list[str], timeout: float = 180,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """``ddlrun -n N python argv...``."""
    return run_ddlrun("-n", str(n), sys.executable, *argv, timeout=timeout,
                      env={**os.environ, **ENV, **(env or {})})
