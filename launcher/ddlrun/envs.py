"""The one registry of the environment variables ddlrun sets for its ranks or reads.

Every other module of the launcher (and ``ddl.perf.spawn``, which starts local ranks through
ddlrun's process set) names a variable through the constants below, never as a string
literal: ``tests/launcher/test_envs.py`` fails on a literal of a registered name outside this
file. The library's own knobs (what ``import ddl`` reads, with types and defaults) are in
``ddl.config``; this registry is the launcher's side: what it hands over and what it takes
from the process managers and schedulers it runs under. Standard library only, like the
rest of the launcher's planning code.

Kinds:

- ``rank``: the env contract every rank gets (torchrun-compatible, plus ddl's own);
- ``torchrun``: torchrun's worker variables, so frameworks that detect torchrun see it;
- ``horovodrun``: horovodrun's worker variables, so Horovod code that reads them sees a job;
- ``option``: set only with an option (``--network-interface``, ``--tcp``, GPU lists) or
  only when the user has not set it;
- ``layout``: ddlrun's own, read by ``ddlrun.rankenv`` on the rank's host under mpirun/srun;
- ``read``: set by someone else (the user, a process manager, a scheduler), read by ddlrun.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    name: str
    kind: str  # rank | torchrun | option | layout | read
    doc: str
    secret: bool = False  # its value is never printed (describe, -v, --dry-run)


def _v(name: str, kind: str, doc: str, secret: bool = False) -> str:
    _REGISTRY[name] = LaunchEnv(name, kind, doc, secret)
    return name


_REGISTRY: dict[str, LaunchEnv] = {}

# --------------------------------------------------------------- the rank contract
RANK = _v("RANK", "rank", "global rank, 0..WORLD_SIZE-1")
WORLD_SIZE = _v("WORLD_SIZE", "rank", "number of ranks in the job")
LOCAL_RANK = _v("LOCAL_RANK", "rank", "rank among the processes on this host")
LOCAL_WORLD_SIZE = _v("LOCAL_WORLD_SIZE", "rank", "processes on this host")
GROUP_RANK = _v("GROUP_RANK", "rank", "index of this host in the job (node rank), 0..hosts-1")
MASTER_ADDR = _v("MASTER_ADDR", "rank",
                 "address of host 0 (its --network-interface address when given)")
MASTER_PORT = _v("MASTER_PORT", "rank", "free port on host 0 for rendezvous")
DDL_OPTIONS = _v("DDL_OPTIONS", "rank",
                 "IBM DDL options, e.g. '-mode r:4x2' (omitted with --no_ddloptions)")
DDL_JOB_ID = _v("DDL_JOB_ID", "rank",
                "unique job id [A-Za-z0-9_.]{1,64}; scopes shared memory (unset with one "
                "ddlrun per node and no --rdzv-id: ddl agrees one at init)")
DDL_JOB_SECRET = _v("DDL_JOB_SECRET", "rank",
                    "the job's secret (new per job) unless the user set DDL_JOB_SECRET or "
                    "DDL_JOB_SECRET_FILE, which then travel instead; never on a command line",
                    secret=True)
DDL_JOB_SECRET_FILE = _v("DDL_JOB_SECRET_FILE", "read",
                         "the user's file holding the job's secret; passed on to the ranks")
DDL_HOST_INDEX = _v("DDL_HOST_INDEX", "rank", "same as GROUP_RANK; scopes shared memory per host")
DDL_HOSTS = _v("DDL_HOSTS", "rank",
               "comma-separated host list of the job, in host-index order (not set with one "
               "ddlrun per node)")

# --------------------------------------------------------------- torchrun's worker env
TORCHELASTIC_RUN_ID = _v("TORCHELASTIC_RUN_ID", "torchrun",
                         "the job id, the first attempt's with --max-restarts, the same in "
                         "every attempt ('none' without one)")
TORCHELASTIC_RESTART_COUNT = _v("TORCHELASTIC_RESTART_COUNT", "torchrun",
                                "which start of the job this is: 0, then 1, 2, ... after each "
                                "restart (--max-restarts)")
TORCHELASTIC_MAX_RESTARTS = _v("TORCHELASTIC_MAX_RESTARTS", "torchrun",
                               "--max-restarts (default 0)")
GROUP_WORLD_SIZE = _v("GROUP_WORLD_SIZE", "torchrun", "number of hosts (nodes) in the job")
ROLE_RANK = _v("ROLE_RANK", "torchrun", "same as RANK")
ROLE_WORLD_SIZE = _v("ROLE_WORLD_SIZE", "torchrun", "same as WORLD_SIZE")
ROLE_NAME = _v("ROLE_NAME", "torchrun", "always 'default'")

# --------------------------------------------------------------- horovodrun's worker env
# (what ``horovodrun --gloo`` gives each worker: Horovod's own test suite and scripts read
# them to tell a launched job from a lone process)
HOROVOD_RANK = _v("HOROVOD_RANK", "horovodrun", "same as RANK")
HOROVOD_SIZE = _v("HOROVOD_SIZE", "horovodrun", "same as WORLD_SIZE")
HOROVOD_LOCAL_RANK = _v("HOROVOD_LOCAL_RANK", "horovodrun", "same as LOCAL_RANK")
HOROVOD_LOCAL_SIZE = _v("HOROVOD_LOCAL_SIZE", "horovodrun", "same as LOCAL_WORLD_SIZE")
HOROVOD_CROSS_RANK = _v("HOROVOD_CROSS_RANK", "horovodrun",
                        "index of this host among the hosts that have a rank of this local "
                        "rank (Horovod's cross rank)")
HOROVOD_CROSS_SIZE = _v("HOROVOD_CROSS_SIZE", "horovodrun",
                        "number of hosts that have a rank of this local rank")

# --------------------------------------------------------------- with an option
CUDA_VISIBLE_DEVICES = _v("CUDA_VISIBLE_DEVICES", "option",
                          "left as the user has it (all GPUs visible: LOCAL_RANK indexes "
                          "them, as under torchrun); the host's GPUs with --include/--exclude "
                          "GPU lists, the rank's one GPU with --bind-gpus")
OMP_NUM_THREADS = _v("OMP_NUM_THREADS", "option",
                     "cores per host // local ranks (min 1), only if the user has not set it")
GLOO_SOCKET_IFNAME = _v("GLOO_SOCKET_IFNAME", "option", "with --network-interface")
NCCL_SOCKET_IFNAME = _v("NCCL_SOCKET_IFNAME", "option", "with --network-interface")
NCCL_IB_DISABLE = _v("NCCL_IB_DISABLE", "option", "'1' with --tcp")
OMPI_MCA_MPI_YIELD_WHEN_IDLE = _v(
    "OMPI_MCA_mpi_yield_when_idle", "option",
    "'1' under mpirun/srun (ddlrun.rankenv) when the host has more ranks than cores, unless "
    "set: Open MPI otherwise spins on cores its peers need (ddlrun's --host h:N hides the "
    "oversubscription from it; a 1 KiB allreduce on 4 ranks of 2 cores took 10 ms)")
PYTHONUNBUFFERED = _v("PYTHONUNBUFFERED", "option",
                      "'1' for the ranks ddl-perf and the tests start (ddl.perf.spawn), so "
                      "their lines arrive as they are printed")

# --------------------------------------------------------------- ddlrun.rankenv's layout
DDLRUN_RANK_HOSTS = _v("DDLRUN_RANK_HOSTS", "layout",
                       "host index of every rank, comma-separated (mpirun, srun)")
DDLRUN_HOST_GPUS = _v("DDLRUN_HOST_GPUS", "layout",
                      "per host 'mode:ids' (see plan_types.HostGpus), hosts joined by ';'")

# --------------------------------------------------------------- read by ddlrun
DDL_PORT = _v("DDL_PORT", "read",
              "ddl's store port (default MASTER_PORT+1): preflight checks it is free")
OMPI_COMM_WORLD_RANK = _v("OMPI_COMM_WORLD_RANK", "read", "Open MPI's rank (ddlrun.rankenv)")
PMIX_RANK = _v("PMIX_RANK", "read", "PMIx's rank (ddlrun.rankenv)")
SLURM_PROCID = _v("SLURM_PROCID", "read", "Slurm's rank (ddlrun.rankenv)")
PMI_RANK = _v("PMI_RANK", "read", "PMI's rank, MPICH and Intel MPI (ddlrun.rankenv)")
SLURM_JOB_ID = _v("SLURM_JOB_ID", "read", "inside a Slurm allocation (--launcher auto)")
SLURM_JOB_NODELIST = _v("SLURM_JOB_NODELIST", "read", "the allocation's hosts, e.g. n[1-4]")
SLURM_NODELIST = _v("SLURM_NODELIST", "read", "older spelling of SLURM_JOB_NODELIST")
SLURM_TASKS_PER_NODE = _v("SLURM_TASKS_PER_NODE", "read", "slots per host, e.g. '2(x3),1'")
SLURM_STEP_TASKS_PER_NODE = _v("SLURM_STEP_TASKS_PER_NODE", "read",
                               "slots per host inside a step (when the above is unset)")
LSB_JOBID = _v("LSB_JOBID", "read", "inside an LSF allocation (--launcher auto)")
LSB_DJOB_HOSTFILE = _v("LSB_DJOB_HOSTFILE", "read", "LSF's file of the allocation's hosts")
LSB_MCPU_HOSTS = _v("LSB_MCPU_HOSTS", "read", "LSF's 'host n host n ...' (without the file)")

# --------------------------------------------------------------- failure records
DDL_ERROR_FILE = _v("DDL_ERROR_FILE", "rank",
                    "where the rank writes its failure record when an uncaught exception ends "
                    "it (a file in a private 0700 folder of the job on the rank's host, "
                    "removed at the end); ddlrun blames the root cause from the records "
                    "(failures.py)")
DDLRUN_ERROR_DIR = _v("DDLRUN_ERROR_DIR", "layout",
                      "under mpirun/srun: the folder ddlrun.rankenv puts each rank's "
                      "DDL_ERROR_FILE in, where it exists on the rank's host")

DDL_FLIGHT_DIR = _v("DDL_FLIGHT_DIR", "rank",
                    "the job's folder for the ranks' flight recorder dumps on each host "
                    "(<tmp>/ddl-flight-<uid>/<job id>, 0700, kept after the job: ddlrun "
                    "names the files; diagnose.py)")

# ------------------------------------------------------------ elastic jobs
DDL_ELASTIC_STORE = _v("DDL_ELASTIC_STORE", "option",
                       "elastic jobs (--min-np/--max-np/--host-discovery-script): HOST:PORT "
                       "of ddlrun's store, where a worker finds its place in each new world "
                       "(guarded by the job's secret; elastic_run.py)")
DDL_ELASTIC_WORKER = _v("DDL_ELASTIC_WORKER", "option",
                        "elastic jobs: the worker's name, host:slot, the same in every world")
DDL_ELASTIC_GENERATION = _v("DDL_ELASTIC_GENERATION", "option",
                            "elastic jobs: the world the worker was started into (0, 1, ...)")
DDL_ELASTIC_TIMEOUT = _v("DDL_ELASTIC_TIMEOUT", "option",
                         "elastic jobs: --elastic-timeout, how long a worker waits for the "
                         "next world")
DDL_INIT_TIMEOUT = _v("DDL_INIT_TIMEOUT", "option",
                      "elastic jobs: --elastic-timeout for a worker started into a world the "
                      "others reach at their next commit (unless the user set it)")

DDL_TIMEOUT_VAR = _v("DDL_TIMEOUT", "read",
                     "how long ddl's collectives wait for a peer (the ranks' own setting, "
                     "from ddlrun's environment or -x): an elastic job's driver waits as long, "
                     "plus 5 s, for the others of a world to leave it after the first did")

# groups the code uses
RANK_FROM_MANAGER = (OMPI_COMM_WORLD_RANK, PMIX_RANK, SLURM_PROCID, PMI_RANK)
SECRET_SOURCES = (DDL_JOB_SECRET, DDL_JOB_SECRET_FILE)  # either: the user has a secret


def registry() -> dict[str, LaunchEnv]:
    """Every registered variable by name (a copy)."""
    return dict(_REGISTRY)


def of_kind(*kinds: str) -> tuple[str, ...]:
    """The names of the given kinds, in registry order."""
    return tuple(v.name for v in _REGISTRY.values() if v.kind in kinds)


def is_secret(name: str) -> bool:
    entry = _REGISTRY.get(name)
    return entry is not None and entry.secret


def table() -> str:
    """The registry as a Markdown table (docs/launcher.md's env section is checked
    against it)."""
    rows = ["| variable | kind | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.kind} | {v.doc} |" for v in _REGISTRY.values()]
    return "\n".join(rows)
