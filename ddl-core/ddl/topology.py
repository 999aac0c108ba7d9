"""Who this process is in the job, from the launch environment (torchrun contract)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from . import config, identity
from .errors import DDLConfigError


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    host_index: int
    num_hosts: int
    job_id: str  # "" until ddl.init has agreed one (see identity.py)
    launched_by_mpi: bool = False

    @property
    def cross_rank(self) -> int:
        return self.host_index

    @property
    def cross_size(self) -> int:
        return self.num_hosts


_MPI_VARS = {  # what process managers set (registered in config), for jobs without ddlrun
    # (horovodrun's last: under horovodrun --mpi both are set, and they agree)
    "RANK": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "HOROVOD_SIZE"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "HOROVOD_LOCAL_RANK"),
    "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "HOROVOD_LOCAL_SIZE"),
}


def _slurm_vars(env: Mapping[str, str]) -> dict[str, str]:
    """A task that srun started (plain ``srun``, or ``--mpi=pmix``/``pmi2``): its layout from
    Slurm's step variables. Only inside a step (SLURM_STEP_ID): a batch script's own shell
    has SLURM_PROCID=0 and the job's SLURM_NTASKS but is one process, not rank 0 of them.
    Open MPI's variables win where mpirun started the ranks (its daemons run as a step), and
    a RANK of the torchrun contract means someone else (ddlrun, torchrun) gave the layout."""
    if (config.get("SLURM_STEP_ID", env) is None or env.get("RANK")
            or config.get("OMPI_COMM_WORLD_RANK", env)):
        return {}
    out = {"RANK": config.get("SLURM_PROCID", env), "WORLD_SIZE": config.get("SLURM_NTASKS", env),
           "LOCAL_RANK": config.get("SLURM_LOCALID", env),
           "GROUP_RANK": config.get("SLURM_NODEID", env)}
    counts = config.get("SLURM_STEP_TASKS_PER_NODE", env)
    node = out["GROUP_RANK"]
    if counts and node is not None and re.fullmatch("[0-9]+", node) and int(node) < len(counts):
        out["LOCAL_WORLD_SIZE"] = str(counts[int(node)])
    return {k: v for k, v in out.items() if v}


def _with_mpi_fallbacks(env: Mapping[str, str]) -> dict[str, str]:
    out = dict(env)
    slurm = _slurm_vars(env)
    for ours, theirs in _MPI_VARS.items():
        if not out.get(ours):
            for name in theirs:
                if name.startswith("HOROVOD_") and env.get("RANK"):
                    continue  # a launcher that gave RANK gave the layout (ddlrun sets both)
                if value := config.get(name, env):
                    out[ours] = value
                    break
    for ours, value in slurm.items():
        if not out.get(ours):
            out[ours] = value
    return out


def world_from_env(env: Mapping[str, str] | None = None) -> World:
    raw = os.environ if env is None else env
    by_mpi = any(config.get(v, raw) for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
    env = _with_mpi_fallbacks(raw)
    size = config.get("WORLD_SIZE", env)
    rank = config.get("RANK", env)
    local_size = config.get("LOCAL_WORLD_SIZE", env)
    local_rank = config.get("LOCAL_RANK", env)
    if local_size is None:
        local_size = size
    if local_rank is None:
        local_rank = rank if local_size == size else rank % local_size
    host_index = config.get("DDL_HOST_INDEX", env)
    if host_index is None and env.get("GROUP_RANK"):
        host_index = config.get("GROUP_RANK", env)
    if size < 1:
        raise DDLConfigError(f"WORLD_SIZE must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise DDLConfigError(f"RANK={rank} is outside 0..{size - 1} (WORLD_SIZE={size})")
    if not 1 <= local_size <= size:
        raise DDLConfigError(f"LOCAL_WORLD_SIZE={local_size} must be in 1..WORLD_SIZE={size}")
    if not 0 <= local_rank < local_size:
        raise DDLConfigError(
            f"LOCAL_RANK={local_rank} is outside 0..{local_size - 1} (LOCAL_WORLD_SIZE)"
        )
    hosts = [h for h in config.get("DDL_HOSTS", env).split(",") if h]
    num_hosts = len(hosts) if hosts else -(-size // local_size)
    # "" when nobody gave the job an id: ddl.init agrees one through the rendezvous
    # the process manager's job name only when it also gave the rank: ranks started by hand
    # inside an mpirun or srun task inherit its variables but are not that job
    manager = identity.manager_job_id(raw) if not raw.get("RANK") else None
    job_id = config.get("DDL_JOB_ID", env) or manager or ""
    if host_index is None:
        host_index = rank // local_size if size % local_size == 0 else 0
    return World(rank, size, local_rank, local_size, host_index, num_hosts, job_id, by_mpi)
