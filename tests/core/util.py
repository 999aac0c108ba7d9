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


def cma_possible() -> bool:
    """Whether this machine lets a process read a child's memory with process_vm_readv (what
    the shared-memory engine's start-up probe decides from): found here independently, with
    a forked child holding a known word."""
    import ctypes

    import numpy as np

    word = np.array([0x5EED_CAFE], np.int64)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only waits
        os.read(r, 1)
        os._exit(0)
    try:
        class IOVec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        got = np.zeros(1, np.int64)
        local = IOVec(got.__array_interface__["data"][0], 8)
        remote = IOVec(word.__array_interface__["data"][0], 8)
        libc = ctypes.CDLL(None, use_errno=True)
        n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        return n == 8 and int(got[0]) == 0x5EED_CAFE
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
