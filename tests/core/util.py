"""Run a worker script of tests/core/workers as N local ranks and check what they report
(the runner and the report reader are tests/procs.py's)."""

from __future__ import annotations

import os

from procs import RankResult, reports, run_workers  # noqa: F401 - reports is re-exported

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")


def run_worker(name: str, n: int, *args: str, env: dict | None = None, timeout: float = 240,
               per_rank_env=None) -> list[RankResult]:
    return run_workers(os.path.join(WORKERS, name), n, *args, env=env, timeout=timeout,
                       per_rank_env=per_rank_env)


def hosts_env(n: int, per: int, **extra: str) -> list[dict]:
    """Per-rank environment that tells ``n`` local ranks they sit ``per`` to a host, so
    ddl plans (and runs) dimensions across "hosts" on one machine."""
    return [dict(LOCAL_WORLD_SIZE=str(per), LOCAL_RANK=str(r % per), DDL_HOST_INDEX=str(r // per),
                 GROUP_RANK=str(r // per), **extra) for r in range(n)]
