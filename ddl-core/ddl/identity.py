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
checked), so the token only has to tell apart two jobs of the same user.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets as _secrets
from collections.abc import Mapping

from . import config
from .errors import DDLConfigError


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
    """A 63-bit mark every shared-memory header of the job carries: derived from the secret
    (so a job id alone does not forge it) or, without one, from the id."""
    key = secret if secret else b"ddl-no-secret"
    mac = hmac.new(key, f"ddl-segment:{job_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(mac[:8], "little") & ((1 << 63) - 1) or 1


def agree_job_id(client, rank: int, size: int, timeout: float, where: str) -> str:
    """The job id, agreed through ddl's rendezvous (``client``: a ``rendezvous.StoreClient``):
    rank 0 draws it; every rank claims its rank number once, so a process of another job
    that reached the same rendezvous (same MASTER_ADDR:MASTER_PORT, no secret) is refused
    instead of joining. A per-job secret makes that impossible in the first place."""
    from .errors import DDLConfigError, DDLTimeoutError

    mark = _secrets.token_hex(8).encode()
    if rank == 0:
        client.set("ddl/job/id", random_job_id().encode())
    got = client.compare_set(f"ddl/job/rank/{rank}", b"", mark)
    if got != mark:
        client.set("ddl/job/conflict", f"rank {rank}".encode())
        raise DDLConfigError(
            f"rank {rank}: another process already joined the rendezvous at {where} as rank "
            f"{rank}: two jobs share MASTER_ADDR:MASTER_PORT. Give each job its own "
            "MASTER_PORT (and a DDL_JOB_SECRET, or start it with ddlrun)"
        )
    keys = [f"ddl/job/rank/{r}" for r in range(size)]
    try:
        client.wait(keys, timeout)
    except DDLTimeoutError:
        missing = [r for r, k in enumerate(keys) if not client.check([k])]
        raise DDLTimeoutError(
            f"rank {rank}: ddl.init(): rank(s) {missing} did not reach the rendezvous at "
            f"{where} within {timeout:g}s (DDL_INIT_TIMEOUT)"
        ) from None
    if client.check(["ddl/job/conflict"]):
        who = client.get("ddl/job/conflict").decode()
        raise DDLConfigError(
            f"rank {rank}: {who} joined the rendezvous at {where} twice: two jobs share "
            "MASTER_ADDR:MASTER_PORT; give each job its own MASTER_PORT"
        )
    return client.get("ddl/job/id", timeout).decode()
