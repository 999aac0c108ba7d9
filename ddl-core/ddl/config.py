"""The one registry of environment variables that PowerDDL reads.

Library code never reads ``os.environ`` directly: it asks this module, so every knob has a
name, a type, a default and a line of documentation in one place (``ddl-perf env`` and
docs/tuning.md list them from here).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import DDLConfigError


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (0/1), got {text!r}")


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (binary units): ``4M`` is 4 MiB."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    if t and t[-1] in "KMG":
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[t[-1]]
        t = t[:-1]
    value = int(float(t) * mult)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return parse


_VARS = [
    # The torchrun contract: set by ddlrun, torchrun, or by hand.
    EnvVar("RANK", int, 0, "global rank of this process"),
    EnvVar("WORLD_SIZE", int, 1, "number of ranks in the job"),
    EnvVar("LOCAL_RANK", int, None, "rank among the processes on this host (default: RANK)"),
    EnvVar("LOCAL_WORLD_SIZE", int, None, "processes on this host (default: WORLD_SIZE)"),
    EnvVar("GROUP_RANK", int, 0, "index of this host (node rank) in the job"),
    EnvVar("MASTER_ADDR", str, "127.0.0.1", "address of rank 0, for cross-host rendezvous"),
    EnvVar("MASTER_PORT", int, 29500, "port of rank 0, for cross-host rendezvous"),
    # PowerDDL's own.
    EnvVar("DDL_OPTIONS", str, "", "IBM DDL option string, e.g. '-mode b:4x2 -dump_iter 100'"),
    EnvVar(
        "DDL_JOB_ID",
        str,
        None,
        "job id that scopes shared memory (set by ddlrun; default: derived from "
        "MASTER_ADDR, MASTER_PORT and WORLD_SIZE)",
    ),
    EnvVar(
        "DDL_HOST_INDEX",
        int,
        None,
        "index of this host in the job, used to scope shared memory (default: GROUP_RANK)",
    ),
    EnvVar("DDL_HOSTS", str, "", "comma-separated host list of the job (set by ddlrun)"),
    EnvVar(
        "DDL_TIMEOUT",
        float,
        30.0,
        "seconds a collective waits for a peer before raising DDLError",
    ),
    EnvVar(
        "DDL_INIT_TIMEOUT",
        float,
        None,
        "seconds ddl.init() (and new_group) waits for the other ranks to arrive "
        "(default: DDL_TIMEOUT)",
    ),
    EnvVar(
        "DDL_JOB_SECRET",
        str,
        None,
        "the job's secret: ddl's rendezvous serves only clients that prove it, and "
        "shared-memory segments carry a token derived from it (set by ddlrun; give every "
        "rank the same value when several launchers start one job)",
    ),
    EnvVar(
        "DDL_JOB_SECRET_FILE",
        str,
        None,
        "file holding the job's secret (a Kubernetes Secret, a file only the job's user "
        "reads); used when DDL_JOB_SECRET is unset",
    ),
    EnvVar(
        "DDL_SHM_SLOT_BYTES",
        _size,
        4 << 20,
        "staging bytes per rank and parity in the shared-memory engine; larger messages "
        "are pipelined in chunks of this size (capped by DDL_SHM_MAX_BYTES)",
    ),
    EnvVar(
        "DDL_SHM_MAX_BYTES",
        _size,
        32 << 20,
        "upper bound on the staging area of the shared-memory engine per host "
        "(Docker's default /dev/shm is 64 MiB)",
    ),
    EnvVar(
        "DDL_SHM_SMALL_BYTES",
        _size,
        64 << 10,
        "messages up to this size use the one-step allreduce (every rank reduces all inputs); "
        "larger ones reduce-scatter then allgather through the staging area",
    ),
    EnvVar(
        "DDL_SHM_WAIT",
        _choice("auto", "spin", "yield", "futex"),
        "auto",
        "wait policy: 'spin' polls, then yields, then sleeps; 'yield' calls sched_yield in "
        "every poll; 'futex' sleeps in the kernel until the peer arrives and wakes it; "
        "'auto' spins when ranks fit the cores and uses futex when they outnumber them",
    ),
    EnvVar(
        "DDL_SHM_HEAP_BYTES",
        _size,
        256 << 20,
        "size of each shared heap segment behind ddl.malloc() (created on first use)",
    ),
    EnvVar(
        "DDL_SHM_CMA",
        _bool,
        False,
        "1: the ranks of a host read and write each other's private buffers of 8 MiB and "
        "more in place (process_vm_readv/writev, probed at start; used only where the "
        "kernel already allows it between every pair); 1.3-1.7x faster than staging for "
        "numpy arrays, not for torch-allocated tensors (docs/performance.md)",
    ),
    EnvVar(
        "DDL_TORCH_SHARE_BYTES",
        _size,
        1 << 20,
        "torch.distributed on ddl: a reused CPU buffer of at least this many bytes that an "
        "allreduce issued during backward sends (DDP's gradient buckets) moves into the "
        "shared heap when it is allreduced again, where peers reduce it in place (0: never)",
    ),
    EnvVar(
        "DDL_SHM_FENCES",
        _bool,
        None,
        "use release/acquire counters (libatomic) in the shared-memory engine; default: "
        "only on weakly ordered CPUs (POWER, aarch64), where they are required",
    ),
    EnvVar(
        "DDL_PORT",
        int,
        None,
        "port of ddl's own rendezvous (an authenticated store on rank 0, bound to "
        "MASTER_ADDR) for the cross-host engines and for jobs that agree their id at init "
        "(default: MASTER_PORT + 1, so torch's own group keeps MASTER_PORT)",
    ),
    EnvVar(
        "DDL_TRANSPORT",
        _choice("auto", "gloo", "mpi"),
        "auto",
        "engine of the dimensions that cross hosts: 'mpi' (mpi4py, communicators split per "
        "grid line) or 'gloo' (torch); 'auto' takes mpi when mpirun/srun started the job",
    ),
    EnvVar(
        "DDL_DEVICE_ENGINE",
        _choice("auto", "nccl", "host", "gloo"),
        "auto",
        "engine for torch tensors on a GPU: 'auto' uses NCCL (one group per grid line) when "
        "torch has it, else stages them through host memory; 'nccl' insists; 'host' always "
        "stages; 'gloo' sends CPU torch tensors through the same per-line torch groups "
        "(testing the device path without a GPU)",
    ),
    EnvVar(
        "DDL_TIMELINE",
        str,
        None,
        "record a Chrome/Perfetto trace of ddl's collectives from ddl.init(): one file per "
        "rank, PATH.json -> PATH.rank0.json, ... ('{rank}' in the path is replaced instead; "
        "written, mode 0600, at stop_timeline, ddl.shutdown() and exit); see "
        "docs/performance.md",
    ),
    EnvVar(
        "DDL_COST_PROFILE",
        str,
        None,
        "JSON cost profile written by `ddl-perf calibrate`: mode b picks each dimension's "
        "algorithm from the measured latency and bandwidth instead of the defaults, and "
        "`ddl-perf simulate` predicts from it",
    ),
    EnvVar(
        "DDL_CHUNK_BYTES",
        _size,
        8 << 20,
        "chunk size of the multi-dimensional allreduce pipeline: chunk i+1's intra-host "
        "work overlaps chunk i's transfer across hosts",
    ),
]


def _ms(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


_VARS += [
    # ddl.torch's DistributedOptimizer (Horovod: HOROVOD_FUSION_THRESHOLD, _CYCLE_TIME);
    # its arguments override these.
    EnvVar("DDL_FUSION_THRESHOLD", _size, 128 << 20,
           "bytes of gradients fused into one allreduce by DistributedOptimizer "
           "(K/M/G suffixes; 0 disables fusion)"),
    EnvVar("DDL_CYCLE_TIME", _ms, 1.0,
           "milliseconds: gradients ready within one cycle share a fusion buffer "
           "(0: fuse by size only)"),
]


def _tasks_per_node(text: str) -> tuple[int, ...]:
    """Slurm's ``2(x3),1`` -> (2, 2, 2, 1)."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"expected counts like '2(x3),1', got {part!r}")
        out += [int(m[1])] * int(m[2] or 1)
    return tuple(out)


def _manager(name: str, doc: str) -> EnvVar:
    return EnvVar(name, str, None, f"set by the process manager: {doc}")


_VARS += [
    # Set by process managers (mpirun, srun, PMIx, horovodrun), never by users: read only when the
    # torchrun variables above are missing, for jobs started without ddlrun. Raw strings;
    # topology copies them into RANK etc., whose types parse them.
    _manager("OMPI_COMM_WORLD_RANK", "Open MPI's rank (RANK when that is unset)"),
    _manager("OMPI_COMM_WORLD_SIZE", "Open MPI's world size (WORLD_SIZE when that is unset)"),
    _manager("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI's rank on this host (LOCAL_RANK)"),
    _manager("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI's ranks on this host (LOCAL_WORLD_SIZE)"),
    _manager("OMPI_MCA_ess_base_jobid", "Open MPI's job id (derives the job id)"),
    _manager("PMI_RANK", "PMI's rank (MPICH, Intel MPI; RANK)"),
    _manager("PMI_SIZE", "PMI's world size (WORLD_SIZE)"),
    _manager("PMI_KVSNAME", "PMI's key-value space name (derives the job id)"),
    _manager("MPI_LOCALRANKID", "MPICH/Intel MPI's rank on this host (LOCAL_RANK)"),
    _manager("MPI_LOCALNRANKS", "MPICH/Intel MPI's ranks on this host (LOCAL_WORLD_SIZE)"),
    _manager("PMIX_RANK", "PMIx's rank (marks a job mpirun started)"),
    _manager("HOROVOD_RANK", "horovodrun's rank (RANK, after the MPI ones)"),
    _manager("HOROVOD_SIZE", "horovodrun's world size (WORLD_SIZE)"),
    _manager("HOROVOD_LOCAL_RANK", "horovodrun's rank on this host (LOCAL_RANK)"),
    _manager("HOROVOD_LOCAL_SIZE", "horovodrun's ranks on this host (LOCAL_WORLD_SIZE)"),
    _manager("PMIX_NAMESPACE", "PMIx's namespace, Open MPI 5 and PRRTE (derives the job id)"),
    _manager("SLURM_PROCID", "Slurm's task rank (RANK)"),
    _manager("SLURM_NTASKS", "Slurm's task count (WORLD_SIZE)"),
    _manager("SLURM_LOCALID", "Slurm's task rank on this node (LOCAL_RANK)"),
    _manager("SLURM_JOB_ID", "Slurm's job id (with SLURM_STEP_ID, derives the job id)"),
    _manager("SLURM_STEP_ID", "Slurm's step id (with SLURM_JOB_ID, derives the job id; "
             "Slurm's variables are read only inside a step)"),
    _manager("SLURM_NODEID", "Slurm's index of this node in the step (GROUP_RANK)"),
    EnvVar("SLURM_STEP_TASKS_PER_NODE", _tasks_per_node, None,
           "set by the process manager: Slurm's tasks on each node of the step, e.g. "
           "'2(x3),1' (with SLURM_NODEID, LOCAL_WORLD_SIZE)"),
]

REGISTRY: dict[str, EnvVar] = {v.name: v for v in _VARS}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of a registered variable, or its default when unset or empty."""
    var = REGISTRY[name]
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw == "":
        return var.default
    try:
        return var.parse(raw)
    except (ValueError, TypeError) as exc:
        raise DDLConfigError(f"{name}={raw!r} is invalid: {exc}") from None


def init_timeout(environ: Mapping[str, str] | None = None) -> float:
    """DDL_INIT_TIMEOUT, or DDL_TIMEOUT when it is unset: one knob bounds every wait."""
    value = get("DDL_INIT_TIMEOUT", environ)
    return get("DDL_TIMEOUT", environ) if value is None else value


def store_port(master_port: int, ddl_port: int | None = None) -> int:
    """The port of ddl's store: DDL_PORT, else MASTER_PORT + 1, so torch's own group keeps
    MASTER_PORT (the core binds it; ddlrun checks it is free before the job starts)."""
    return ddl_port or master_port + 1


def describe() -> list[tuple[str, str, str]]:
    """(name, default, doc) for every variable, for docs and ``ddl-perf env``."""
    return [(v.name, "" if v.default is None else str(v.default), v.doc) for v in _VARS]
