"""Run a worker script as N local ranks and check what they report."""

from __future__ import annotations

import json
import os

from ddl.perf.spawn import RankResult, run_local

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")


def run_worker(name: str, n: int, *args: str, env: dict | None = None, timeout: float = 240,
               per_rank_env=None) -> list[RankResult]:
    return run_local(n, [os.path.join(WORKERS, name), *args], env=env, timeout=timeout,
                     per_rank_env=per_rank_env)


def hosts_env(n: int, per: int, **extra: str) -> list[dict]:
    """Per-rank environment that tells ``n`` local ranks they sit ``per`` to a host, so
    ddl plans (and runs) dimensions across "hosts" on one machine."""
    return [dict(LOCAL_WORLD_SIZE=str(per), LOCAL_RANK=str(r % per), DDL_HOST_INDEX=str(r // per),
                 GROUP_RANK=str(r // per), **extra) for r in range(n)]


def reports(results: list[RankResult]) -> list[dict]:
    """The last JSON line each rank printed; fails with every rank's stderr otherwise."""
    out = []
    for r in results:
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode != 0 or not lines:
            detail = "\n".join(f"--- rank {x.rank} exit {x.returncode}\n{x.stdout[-2000:]}\n"
                               f"{x.stderr[-4000:]}" for x in results)
            raise AssertionError(f"rank {r.rank} failed:\n{detail}")
        out.append(json.loads(lines[-1]))
    return out
