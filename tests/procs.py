"""The one way tests run ranks and ddlrun: N local ranks of a worker script
(``run_workers``, through ddl.perf.spawn with the torchrun contract), what they reported
(``reports``), and ddlrun as a real process (``ddlrun_argv``/``run_ddlrun``). Each tests
folder wraps these with its own workers folder (tests/core/util.py, tests/torch/torch_util.py,
tests/launcher/ddlrun_testlib.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from ddl.perf.spawn import RankResult, run_local

PY = sys.executable


def run_workers(script: str, n: int, *args: str, env: dict | None = None,
                timeout: float = 240, per_rank_env: list[dict] | None = None
                ) -> list[RankResult]:
    """``script`` as ``n`` local ranks; every rank's exit code and output."""
    return run_local(n, [script, *args], env=env, timeout=timeout, per_rank_env=per_rank_env)


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


def ddlrun_argv(*args: str) -> list[str]:
    return [PY, "-m", "ddlrun", *args]


def run_ddlrun(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """``ddlrun *args``, output captured as text; ``kw`` as subprocess.run's (``env`` is
    the whole environment)."""
    return subprocess.run(ddlrun_argv(*args), capture_output=True, text=True, timeout=timeout,
                          **kw)
