"""Who the job is: its id (which scopes shared memory) and its secret (which guards the
rendezvous and marks the job's shared-memory segments).

Where they come from, first match wins:

1. ``DDL_JOB_ID`` (+ ``DDL_JOB_SECRET`` or ``DDL_JOB_SECRET_FILE``): set by ddlrun for every
   rank, or by the user when several launchers start one job.
2. The process manager's own job name when mpirun (PMIx, Open MPI) or srun started the job:
   unique among the jobs running on a host, so two plain ``mpirun -np 2`` never share an id.
3. Otherwise (ranks started by hand or by torchrun with only the torchrun variables) the
   ranks agree at init through ddl's rendezvous: rank 0 draws a random id and publishes it
   (``api.init``). Binding the rendezvous port is what makes that id the job's alone.

The *token* written into segment headers is derived from the secret when there is one and
from the job id otherwise: another user cannot open our segments at all (mode 0600, owner
checked), so the token only has to tell apart two jobs of the same user, and what a cleanup
may remove. With a secret, segment *names* carry a key too, so another user cannot compute
them in advance (``engines/orphans.py``).
"""

from __future__ import annotations

import hashlib
import os
import secrets as _secrets
import time
from collections.abc import Mapping

from . import config
from .engines import orphans
from .errors import DDLConfigError, DDLError, DDLTimeoutError
from .rendezvous import StoreClient


def job_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret from ``DDL_JOB_SECRET`` or the file ``DDL_JOB_SECRET_FILE``."""
    value = config.get("DDL_JOB_SECRET", env)
    if value:
        return value.encode()
    path = config.get("DDL_JOB_SECRET_FILE", env)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read().strip()
    except OSError as exc:
        raise DDLConfigError(
            f"DDL_JOB_SECRET_FILE={path!r} cannot be read ({exc.strerror}): every rank needs "
            "the same secret file"
        ) from None
    if not data:
        raise DDLConfigError(f"DDL_JOB_SECRET_FILE={path!r} is empty")
    return data


def manager_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """A job id from the process manager that started this rank (None when there is none):
    PMIx's namespace (Open MPI 5, PRRTE), Open MPI's jobid, or Slurm's job and step."""
    env = os.environ if env is None else env
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME"):
        if value := config.get(name, env):
            return _from_name(name, value)
    job, step = config.get("SLURM_JOB_ID", env), config.get("SLURM_STEP_ID", env)
    if job and step:
        return _from_name("SLURM", f"{job}.{step}")
    return None


def _from_name(kind: str, value: str) -> str:
    digest = hashlib.sha256(f"{kind}={value}".encode()).hexdigest()[:16]
    return f"pm{digest}"


def random_job_id() -> str:
    return "auto" + _secrets.token_hex(8)


def new_secret() -> str:
    """A secret for a job that has none (what ddlrun hands its ranks)."""
    return _secrets.token_urlsafe(32)


def segment_token(job_id: str, secret: bytes | None) -> int:
    """A 63-bit mark every shared-memory segment of the job carries: derived from the secret
    (so a job id alone does not forge it) or, without one, from the id. The one rule lives
    with the other segment rules in ``engines/orphans.py`` (standard library only)."""
    return orphans.segment_token(job_id, secret)


CONFLICT = "ddl/job/conflict"  # who showed that two jobs share the rendezvous


def agree_job_id(client, rank: int, size: int, timeout: float, where: str,
                 settle: float = 0.0) -> str:
    """The job id, agreed through ddl's rendezvous (``client``: a ``rendezvous.StoreClient``):
    rank 0 draws it; every rank claims its rank number once.

    Without a secret nothing proves that a rank belongs to the job whose rendezvous it
    reached: two jobs started by hand on one MASTER_ADDR:MASTER_PORT meet at whichever
    rank 0 bound the port first, and a stranger that claims a rank before the job's own
    process would complete the job with foreign data. Such a collision always shows itself
    twice: the displaced rank finds its number claimed, and the other job's rank 0 cannot
    bind the port (``report_second_owner``). Either writes ``CONFLICT``, which fails every
    rank of the job. ``settle``: seconds every rank waits, once all ranks have claimed,
    for such a sign before it trusts the membership (only where there is no secret: with
    one, a stranger cannot join at all)."""

    mark = _secrets.token_hex(8).encode()
    if rank == 0:
        client.set("ddl/job/id", random_job_id().encode())
    got = client.compare_set(f"ddl/job/rank/{rank}", b"", mark)
    if got != mark:
        client.set(CONFLICT, f"a second process claimed rank {rank}".encode())
        raise DDLConfigError(
            f"rank {rank}: another process already joined the rendezvous at {where} as rank "
            f"{rank}: two jobs share MASTER_ADDR:MASTER_PORT (both fail rather than mix). "
            "Give each job its own MASTER_PORT (and a DDL_JOB_SECRET, or start it with ddlrun)"
        )
    keys = [f"ddl/job/rank/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout
    while True:  # in slices, so that a sign of a second job ends the wait at once
        left = deadline - time.monotonic()
        try:
            client.wait(keys, max(0.0, min(left, _SLICE)))
            break
        except DDLTimeoutError:
            _check_conflict(client, rank, where)
            if left <= _SLICE:
                missing = [r for r, k in enumerate(keys) if not client.check([k])]
                raise DDLTimeoutError(
                    f"rank {rank}: ddl.init(): rank(s) {missing} did not reach the rendezvous "
                    f"at {where} within {timeout:g}s (DDL_INIT_TIMEOUT)"
                ) from None
    if settle > 0:
        try:  # returns at once when a sign of a second job comes
            client.wait([CONFLICT], settle)
        except DDLTimeoutError:
            pass
    _check_conflict(client, rank, where)
    return client.get("ddl/job/id", timeout).decode()


_SLICE = 0.25  # seconds between looks for a conflict while ranks are still arriving


def _check_conflict(client, rank: int, where: str) -> None:
    if client.check([CONFLICT]):
        who = client.get(CONFLICT).decode()
        raise DDLConfigError(
            f"rank {rank}: two jobs share ddl's rendezvous at {where} ({who}), so this job "
            "may hold another job's ranks: it stops rather than mix their data. Give each job "
            "its own MASTER_PORT (and a DDL_JOB_SECRET, or start it with ddlrun)"
        )


def report_second_owner(addr: str, port: int, generation: int | None, timeout: float) -> bool:
    """Tell the job whose rendezvous holds ``addr:port`` that another job's rank 0 (this
    process, which could not bind it) exists: that job may have taken in this job's other
    ranks, so it must not complete (``agree_job_id``). Only an open store (no secret) can be
    told, and only one of the same ``ddl.init()`` generation. Whether it was told."""

    try:
        client = StoreClient(addr, port, None, rank=0, timeout=timeout, generation=generation)
    except DDLError:
        return False
    try:
        client.set(CONFLICT, f"a second rank 0 (pid {os.getpid()}) could not bind it".encode())
        return True
    except DDLError:
        return False
    finally:
        client.close()
