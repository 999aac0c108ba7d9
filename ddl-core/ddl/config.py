"""The one registry of environment variables that PowerDDL reads.

Library code never reads ``os.environ`` directly: it asks this module, so every knob has a
name, a type, a default, for a number the range the code can honour, and a line of
documentation in one place (``ddl-perf env`` and docs/tuning.md list them from here). A
value that does not parse or lies outside its range is one DDLConfigError line naming the
variable, the value and the range.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

from .errors import DDLConfigError


@dataclass(frozen=True)
class EnvVar:
    """One variable: its parser, default and doc, and for a number the range the code can
    honour (``low``..``high``, inclusive; ``unit`` names what the bounds count). ``get``
    refuses a value outside it, and the docs table shows it (``allowed``)."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    low: float | None = None
    high: float | None = None
    unit: str = ""

    def show(self, value: Any) -> str:
        """A value as the docs write it: sizes with their suffix (``4M``), numbers as %g."""
        if value is None:
            return ""
        if isinstance(value, str):  # a word the parser allows beside numbers (``auto``)
            return value
        if self.unit == "bytes":
            return show_size(value)
        if isinstance(value, float):
            return f"{value:g}"
        return str(value)

    @property
    def allowed(self) -> str:
        """The range as errors and docs show it, e.g. ``64K..1P bytes``; "" when none."""
        if self.low is None and self.high is None:
            return ""
        if self.high is None:
            span = f">= {self.show(self.low)}"
        elif self.low is None:
            span = f"<= {self.show(self.high)}"
        else:
            span = f"{self.show(self.low)}..{self.show(self.high)}"
        return f"{span} {self.unit}".rstrip()

    def inside(self, value: Any) -> bool:
        """Whether a parsed value lies within the range (NaN never does; a word such as
        ``auto`` has no place in it and is always allowed)."""
        if isinstance(value, str):
            return True
        return ((self.low is None or value >= self.low)
                and (self.high is None or value <= self.high))


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (0/1), got {text!r}")


def _auto_bool(text: str) -> bool | str:
    """``auto`` or a boolean."""
    return "auto" if text.strip().lower() == "auto" else _bool(text)


def _int(text: str) -> int:
    """A whole number in ASCII digits (``int`` alone also takes ``1_000`` and other
    scripts' digits)."""
    if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
        raise ValueError(f"expected a whole number, got {text!r}")
    return int(text)


_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?"


def _number(text: str) -> float:
    """A finite decimal number (``float`` alone also takes ``nan``, ``inf`` and ``1e999``)."""
    if not re.fullmatch(_NUMBER, text.strip()):
        raise ValueError(f"expected a number, got {text!r}")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = re.compile(rf"(?P<num>{_NUMBER})\s*(?P<unit>[KMGTP]?)(?:I?B)?", re.IGNORECASE)


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G/T/P suffix (binary units): ``4M`` is 4 MiB."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"expected bytes like 65536, 64K, 4M or 1G, got {text!r}")
    # exact (no float rounding of large values; the exponent is at most 4 digits)
    value = int(Fraction(m["num"]) * _SIZE_UNITS[m["unit"].upper()])
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _auto_size(text: str) -> int | str:
    """``auto`` or bytes (``_size``)."""
    return "auto" if text.strip().lower() == "auto" else _size(text)


def show_size(n: int) -> str:
    """Bytes with the largest suffix that divides them: 65536 -> ``64K``."""
    for suffix in ("P", "T", "G", "M", "K"):
        unit = _SIZE_UNITS[suffix]
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


# the ranges: what the code can honour
PORTS = dict(low=1, high=65535)
MAX_RANKS = 1 << 20  # ranks in a job
MAX_LOCAL_RANKS = 4096  # ranks on one host (ddlrun's cap on slots per host)
SECONDS = dict(low=0.001, high=7 * 24 * 3600.0, unit="seconds")  # a week at most
MAX_BYTES = 1 << 50  # 1 PiB: more than any host's memory, far from int64's end
SLOT_MIN = 64 << 10  # the shared-memory engine's staging per rank and parity, at least
HEAP_MIN = 1 << 20  # a shared heap segment, at least (engines/heap.py rounds up to it)
CHUNK_MIN = 4 << 10  # a pipeline chunk, at least (algorithms/multidim.py, engines/device.py)


def _bytes(low: int) -> dict:
    return dict(low=low, high=MAX_BYTES, unit="bytes")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return parse


_VARS = [
    # The torchrun contract: set by ddlrun, torchrun, or by hand.
    EnvVar("RANK", _int, 0, "global rank of this process", low=0, high=MAX_RANKS - 1),
    EnvVar("WORLD_SIZE", _int, 1, "number of ranks in the job", low=1, high=MAX_RANKS),
    EnvVar("LOCAL_RANK", _int, None, "rank among the processes on this host (default: RANK)",
           low=0, high=MAX_LOCAL_RANKS - 1),
    EnvVar("LOCAL_WORLD_SIZE", _int, None, "processes on this host (default: WORLD_SIZE)",
           low=1, high=MAX_LOCAL_RANKS),
    EnvVar("GROUP_RANK", _int, 0, "index of this host (node rank) in the job", low=0,
           high=MAX_RANKS - 1),
    EnvVar("MASTER_ADDR", str, "127.0.0.1", "address of rank 0, for cross-host rendezvous"),
    EnvVar("MASTER_PORT", _int, 29500, "port of rank 0, for cross-host rendezvous", **PORTS),
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
        _int,
        None,
        "index of this host in the job, used to scope shared memory (default: GROUP_RANK)",
        low=0,
        high=MAX_RANKS - 1,
    ),
    EnvVar("DDL_HOSTS", str, "", "comma-separated host list of the job (set by ddlrun)"),
    EnvVar(
        "DDL_TIMEOUT",
        _number,
        30.0,
        "seconds a collective waits for a peer before raising DDLError",
        **SECONDS,
    ),
    EnvVar(
        "DDL_INIT_TIMEOUT",
        _number,
        None,
        "seconds ddl.init() (and new_group) waits for the other ranks to arrive "
        "(default: DDL_TIMEOUT)",
        **SECONDS,
    ),
    EnvVar(
        "DDL_RENDEZVOUS_SETTLE",
        _number,
        1.0,
        "seconds ranks started without a job id or secret (by hand, torchrun) wait at init, "
        "once all have arrived, for a sign that another job shares their rendezvous port "
        "before they trust who joined (0: do not wait; see docs/security.md)",
        low=0.0,
        high=60.0,
        unit="seconds",
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
        "are pipelined in chunks of this size (capped by DDL_SHM_MAX_BYTES / (2 x ranks on "
        "the host), in whole pages)",
        **_bytes(SLOT_MIN),
    ),
    EnvVar(
        "DDL_SHM_MAX_BYTES",
        _size,
        32 << 20,
        "upper bound on the staging area of the shared-memory engine per host "
        "(Docker's default /dev/shm is 64 MiB); it must leave 64 KiB per rank and parity: "
        "at least 128K x the ranks on the host",
        **_bytes(2 * SLOT_MIN),
    ),
    EnvVar(
        "DDL_SHM_SMALL_BYTES",
        _auto_size,
        "auto",
        "messages up to this size use the one-step allreduce (every rank reduces all inputs); "
        "larger ones reduce-scatter then allgather through the staging area; 'auto': 256K "
        "when a host has 2 ranks (both move the same bytes between them), 64K otherwise",
        **_bytes(0),
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
        **_bytes(HEAP_MIN),
    ),
    EnvVar(
        "DDL_SHM_CMA",
        _auto_bool,
        "auto",
        "the ranks of a host read and write each other's private buffers of 8 MiB and more "
        "in place (process_vm_readv/writev, probed at start; used only where the kernel "
        "already allows it between every pair): 'auto' those on transparent huge pages "
        "(numpy's arrays; a buffer used again, such as the gradients the DistributedOptimizer "
        "reduces, is collapsed into huge pages once), 1 every one, 0 none (staged through "
        "the shared slots)",
    ),
    EnvVar(
        "DDL_TORCH_SHARE_BYTES",
        _size,
        1 << 20,
        "torch.distributed on ddl: a reused CPU buffer of at least this many bytes that an "
        "allreduce issued during backward sends (DDP's gradient buckets) moves into the "
        "shared heap when it is allreduced again, where peers reduce it in place (0: never)",
        **_bytes(0),
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
        _int,
        None,
        "port of ddl's own rendezvous (an authenticated store on rank 0, bound to "
        "MASTER_ADDR) for the cross-host engines and for jobs that agree their id at init "
        "(default: MASTER_PORT + 1, so torch's own group keeps MASTER_PORT)",
        **PORTS,
    ),
    EnvVar(
        "DDL_TRANSPORT",
        _choice("auto", "gloo", "mpi"),
        "auto",
        "engine of the dimensions that cross hosts: 'mpi' (mpi4py, communicators split per "
        "grid line) or 'gloo' (torch); 'auto' takes mpi when mpirun/srun started the job",
    ),
    EnvVar(
        "DDL_GLOO_BESIDE_MPI",
        _choice("auto", "1", "0"),
        "auto",
        "on the mpi transport, a dimension across hosts may also run a size range on Gloo's "
        "allreduce where it is faster: 'auto' in mode p (timed at start) and in mode b where "
        "DDL_COST_PROFILE measured both engines on it; '1' gives every b and p dimension the "
        "Gloo group (ddl-perf calibrate sets it, to measure Gloo); '0': MPI alone. Only when "
        "every rank can reach rank 0's rendezvous (MASTER_ADDR set, as ddlrun does) and "
        "import torch",
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
        **_bytes(CHUNK_MIN),
    ),
]


_VARS += [
    # ddl.torch's DistributedOptimizer (Horovod: HOROVOD_FUSION_THRESHOLD, _CYCLE_TIME);
    # its arguments override these.
    EnvVar("DDL_FUSION_THRESHOLD", _size, 128 << 20,
           "bytes of gradients fused into one allreduce by DistributedOptimizer "
           "(K/M/G suffixes; 0 disables fusion)", **_bytes(0)),
    EnvVar("DDL_CYCLE_TIME", _number, 1.0,
           "milliseconds: gradients ready within one cycle share a fusion buffer "
           "(0: fuse by size only)", low=0.0, high=60_000.0, unit="ms"),
    # Horovod's stall check, for named calls (matched by name): their names.
    EnvVar("HOROVOD_STALL_CHECK_TIME_SECONDS", _number, 60.0,
           "seconds a named call may wait for ranks that have not submitted it before "
           "one warning names them and the call", low=0.0, high=1e9, unit="s"),
    EnvVar("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", _number, 0.0,
           "seconds after which such a stall fails the waiting named calls on every rank "
           "with that list (0: never)", low=0.0, high=1e9, unit="s"),
    EnvVar("HOROVOD_STALL_CHECK_DISABLE", _bool, False,
           "1: no stall warning (the shutdown time still applies)"),
]


def _tasks_per_node(text: str) -> tuple[int, ...]:
    """Slurm's ``2(x3),1`` -> (2, 2, 2, 1)."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", part.strip())
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

_VARS += [
    EnvVar("DDL_DEBUG", _bool, False,
           "1: show ddl's errors with their whole traceback and internal chain (by default "
           "an uncaught error shows two of ddl's frames, the call into ddl and the line "
           "that raised, and no internal chain: the message says what happened)"),
]

_VARS += [
    EnvVar("DDL_FLIGHT_RECORDER", _int, 2048,
           "entries in each rank's flight recorder, the ring of its last collectives "
           "(kind, name, dtype and shape, sequence number, state, times); dumped on a "
           "timeout, a peer's loss or a mismatch and on SIGURG (ddlrun --diagnose); 0: off",
           low=0, high=1 << 20),
    EnvVar("DDL_FLIGHT_DIR", str, None,
           "folder of the flight recorder's dumps (rank<N>.json, rank<N>.stacks.txt; mode "
           "0600); ddlrun sets one per job; unset: <tmp>/ddl-flight-<uid>/<job id>"),
]

_VARS += [
    # Set by ddlrun for every rank (the launcher's registry has it too).
    EnvVar("DDL_ERROR_FILE", str, None,
           "where this rank writes its failure record (JSON: the uncaught exception, the "
           "user's frame, the time, whether a peer's failure caused it) when it dies of an "
           "exception; ddlrun sets it per rank and blames the root cause from the records "
           "(unset: no record)"),
]

_VARS += [
    # Set by ddlrun for every worker of an elastic job (--min-np/--max-np, discovery).
    EnvVar("DDL_ELASTIC_STORE", str, None,
           "HOST:PORT of ddlrun's elastic store, which tells a worker its place in each new "
           "world (ddl.elastic.run) and announces host changes; the job's secret guards it"),
    EnvVar("DDL_ELASTIC_WORKER", str, None,
           "this worker's name in an elastic job (host:slot): the key of its place"),
    EnvVar("DDL_ELASTIC_GENERATION", _int, 0,
           "the world this worker was started into (an elastic job counts them from 0)",
           low=0, high=1 << 30),
    EnvVar("DDL_ELASTIC_TIMEOUT", _number, 600.0,
           "seconds a worker of an elastic job waits for the next world after a reset "
           "(ddlrun --elastic-timeout)", low=0.1, high=1e7),
]

REGISTRY: dict[str, EnvVar] = {v.name: v for v in _VARS}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of a registered variable, or its default when unset or empty.
    DDLConfigError, one line naming the variable, the value and the allowed range, when the
    value does not parse or lies outside the range."""
    var = REGISTRY[name]
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw == "":
        return var.default
    allowed = f" (allowed: {var.allowed})" if var.allowed else ""
    try:
        value = var.parse(raw)
    except (ValueError, TypeError, OverflowError) as exc:
        raise DDLConfigError(f"{name}={raw!r} is invalid: {exc}{allowed}") from None
    if not var.inside(value):
        raise DDLConfigError(f"{name}={raw!r} is out of range{allowed}")
    return value


def init_timeout(environ: Mapping[str, str] | None = None) -> float:
    """DDL_INIT_TIMEOUT, or DDL_TIMEOUT when it is unset: one knob bounds every wait."""
    value = get("DDL_INIT_TIMEOUT", environ)
    return get("DDL_TIMEOUT", environ) if value is None else value


def store_port(master_port: int, ddl_port: int | None = None) -> int:
    """The port of ddl's store: DDL_PORT, else MASTER_PORT + 1, so torch's own group keeps
    MASTER_PORT (the core binds it; ddlrun checks it is free before the job starts)."""
    port = ddl_port or master_port + 1
    if port > PORTS["high"]:
        raise DDLConfigError(
            f"MASTER_PORT={master_port} leaves no port for ddl's store (MASTER_PORT + 1 = "
            f"{port} is above {PORTS['high']}): set DDL_PORT, or a lower MASTER_PORT")
    return port


class Row(NamedTuple):
    name: str
    default: str  # "" when the variable has none
    allowed: str  # "" when any value its parser takes is allowed
    doc: str


def describe() -> list[Row]:
    """One row per variable, for docs and ``ddl-perf env``."""
    return [Row(v.name, v.show(v.default), v.allowed, v.doc) for v in _VARS]


def markdown() -> str:
    """The table of docs/tuning.md (``ddl-perf env --markdown``; ``make docs`` puts it
    there)."""
    lines = ["| variable | default | allowed | meaning |", "|---|---|---|---|"]
    lines += [f"| `{r.name}` | {r.default or '-'} | {r.allowed or '-'} | {r.doc} |"
              for r in describe()]
    return "\n".join(lines)
