"""``python -m ddlrun.rankenv -- program args``: the per-rank env contract for launchers that
start ranks themselves (mpirun, srun). Reads the rank from the launcher's variables
(OMPI_COMM_WORLD_RANK, PMIX_RANK, SLURM_PROCID, PMI_RANK), the job layout from
DDLRUN_RANK_HOSTS (host index of every rank, comma-separated) and DDLRUN_HOST_GPUS (per
host ``mode:ids``, hosts joined by ';': see ``plan_types.HostGpus``), sets RANK, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, DDL_HOST_INDEX, ROLE_RANK, horovodrun's HOROVOD_RANK,
HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK/SIZE, OMP_NUM_THREADS, only with
--include/--exclude GPU lists or --bind-gpus CUDA_VISIBLE_DEVICES (as ddlrun.plan does), and
OMPI_MCA_mpi_yield_when_idle=1 when the host has more ranks than cores, DDL_ERROR_FILE in
DDLRUN_ERROR_DIR where that folder exists on this host (failures.py), and execs the
program.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from . import envs
from .diagnose import flight_folder
from .failures import record_path
from .hosts import digits
from .plan_env import cross_of, rank_env
from .plan_types import HostFacts, HostGpus

RANK_VARS = envs.RANK_FROM_MANAGER


def compute(env: Mapping[str, str], cores: int) -> dict[str, str]:
    rank = next((int(env[v]) for v in RANK_VARS if digits(env.get(v, ""))), None)
    if rank is None:
        raise SystemExit("ddlrun.rankenv: no rank variable set (" + ", ".join(RANK_VARS) + ")")
    layout = [int(x) for x in env[envs.DDLRUN_RANK_HOSTS].split(",")]
    gpus = [HostGpus.decode(x) for x in env.get(envs.DDLRUN_HOST_GPUS, "").split(";") if x]
    host = layout[rank]
    local_rank = layout[:rank].count(host)
    local_size = layout.count(host)
    facts = HostFacts(cores=cores)
    sizes = [layout.count(h) for h in range(max(layout) + 1)]
    out = rank_env(rank, local_rank, local_size, host, facts, env,
                   gpus[host] if host < len(gpus) else None,
                   cross_of(sizes, host, local_rank))
    if local_size > cores and envs.OMPI_MCA_MPI_YIELD_WHEN_IDLE not in env:
        out[envs.OMPI_MCA_MPI_YIELD_WHEN_IDLE] = "1"
    if env.get(envs.DDL_JOB_ID) and envs.DDL_FLIGHT_DIR not in env:
        out[envs.DDL_FLIGHT_DIR] = flight_folder(env[envs.DDL_JOB_ID])
    folder = env.get(envs.DDLRUN_ERROR_DIR, "")
    if folder and os.path.isdir(folder):  # on ddlrun's host (or a shared filesystem)
        out[envs.DDL_ERROR_FILE] = record_path(folder, rank)
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m ddlrun.rankenv -- program [args]", file=sys.stderr)
        return 2
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    env = dict(os.environ)
    env.update(compute(env, cores))
    try:
        os.execvpe(args[0], args, env)
    except OSError as exc:
        print(f"ddlrun.rankenv: cannot run {args[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
