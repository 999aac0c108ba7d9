"""Start N local ranks of a Python module with the torchrun env contract, collect their
output, and never leave one behind. Used by ddl-perf and the tests; jobs across hosts go
through ddlrun."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..engines import segments


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(avoid: Sequence[int] = ()) -> int:
    """A port P with P and P + 1 both free (torch's MASTER_PORT and ddl's store at
    MASTER_PORT + 1), taken below the ephemeral range: a port the kernel handed out would
    soon be some connection's source port, and P + 1 could be anybody's. ``avoid``: ports
    already given to another job of this run."""
    top = _ephemeral_low() - 2
    rng = random.Random()
    for _ in range(500):
        p = rng.randrange(max(1024, top - 12000), top)
        if any(abs(p - q) <= 1 for q in avoid):
            continue
        if _bindable(p) and _bindable(p + 1):
            return p
    raise OSError("no free pair of ports below the ephemeral range")


def new_job_id(prefix: str = "job") -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def rank_env(rank: int, n: int, job_id: str, port: int,
             extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
        GROUP_RANK="0", DDL_HOST_INDEX="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        DDL_JOB_ID=job_id, OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        PYTHONUNBUFFERED="1",
    )
    if extra:
        env.update(extra)
    return env


def run_local(n: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              per_rank_env: Sequence[Mapping[str, str]] | None = None,
              timeout: float = 120.0, job_id: str | None = None) -> list[RankResult]:
    """Run ``python argv...`` as ranks 0..n-1 of one job; return when all exit.

    On timeout every rank is killed and a TimeoutError raised. The job's shared memory is
    removed afterwards whatever happened.
    """
    job_id = job_id or new_job_id()
    port = free_port()
    procs: list[tuple[subprocess.Popen, object, object]] = []
    try:
        for r in range(n):
            e = rank_env(r, n, job_id, port, env)
            if per_rank_env:
                e.update(per_rank_env[r])
            # Files, not pipes: a chatty rank must not block on a full pipe while we wait
            # for another one.
            so = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in finally
            se = tempfile.TemporaryFile("w+")  # noqa: SIM115
            p = subprocess.Popen([sys.executable, *argv], env=e, stdout=so, stderr=se,
                                 text=True, start_new_session=True)
            procs.append((p, so, se))
        deadline = time.monotonic() + timeout
        for p, _, _ in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"job {job_id}: ranks still running after {timeout:.0f}s"
                ) from None
        results = []
        for r, (p, so, se) in enumerate(procs):
            so.seek(0)
            se.seek(0)
            results.append(RankResult(r, p.returncode, so.read(), se.read()))
        return results
    finally:
        for p, so, se in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
            so.close()
            se.close()
        segments.cleanup_job(job_id)
