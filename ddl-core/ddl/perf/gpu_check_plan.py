"""What ``ddl-perf gpu-check`` runs, decided before anything runs: the checks of the GPU
path, each a list of jobs (argv after ``ddlrun -n N --timeout T``, extra environment, own
deadline), for a number of visible GPUs, all within one time budget.

Pure: no process is started and nothing is imported from torch here, so the plan is unit-
tested on any machine. ``simulate=True`` plans the same checks for CPU tensors (the device
engine over Gloo, ``DDL_DEVICE_ENGINE=gloo``; torch's Gloo group stands in for its NCCL
one; tiny sizes and models): how the whole pipeline is tested on a machine without a GPU.

Ranks: one per visible GPU (``set_device(LOCAL_RANK)``, as ddlrun and torchrun place them),
except the multi-dimensional allreduce, which needs a grid of at least two dimensions of
size > 1: the largest rank count up to the GPUs that has one (4 -> 2x2, 6 -> 2x3, 8 ->
2x2x2; 5 and 7 use 4 and 6 of them).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

BUDGET_S = 450.0  # every check's deadline together: under 8 minutes with start-up and report
WORKERS = "ddl.perf.gpu_check_workers"  # python -m WORKERS CHECK ...
PERF = "ddl.perf.cli"  # python -m PERF allreduce|train ...
MARK = "GPU-CHECK-RESULT "  # a check worker's rank 0 prints MARK + its result as JSON


@dataclass(frozen=True)
class Job:
    """One ddlrun job: ``ranks`` processes of ``python -m module *args``, with ``env`` on
    top of the caller's, stopped after ``timeout`` seconds. ``json``: the file the job
    writes its result to (ddl-perf's ``--json``), read back by the runner; None for the
    check workers, whose rank 0 prints its result as one tagged line."""

    name: str
    ranks: int
    module: str
    args: tuple[str, ...]
    timeout: float
    env: tuple[tuple[str, str], ...] = ()
    json: str | None = None


@dataclass(frozen=True)
class Check:
    """One line of the report: what it proves (``title``), its jobs, and, when it cannot run
    here, why (``skip``: nothing is started)."""

    name: str
    title: str
    jobs: tuple[Job, ...] = ()
    skip: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def timeout(self) -> float:
        return sum(j.timeout for j in self.jobs)


def grid_for(gpus: int) -> tuple[int, ...] | None:
    """The grid of the multi-dimensional check: the most dimensions of size > 1 that the
    largest usable rank count up to ``gpus`` factors into (2s first, the rest last); None
    below 4 GPUs, where no grid has two dimensions."""
    for ranks in range(gpus, 3, -1):
        dims, rest = [], ranks
        while rest % 2 == 0 and rest > 2:
            dims.append(2)
            rest //= 2
        if dims and rest > 1:
            return (*dims, rest)
    return None


def _env(simulate: bool, **extra: str) -> tuple[tuple[str, str], ...]:
    engine = {"DDL_DEVICE_ENGINE": "gloo" if simulate else "nccl"}
    return tuple(sorted({**engine, **extra}.items()))


def _worker(name: str, ranks: int, timeout: float, simulate: bool, *args: str,
            **env: str) -> Job:
    flag = ("--simulate-cpu",) if simulate else ()
    return Job(name, ranks, WORKERS, (name, *flag, *args), timeout, _env(simulate, **env))


def _allreduce(gpus: int, simulate: bool, out: str) -> Check:
    """``ddl-perf allreduce -g cuda`` with torch's own NCCL group in the same job."""
    path = os.path.join(out, "raw", "allreduce.json")
    if simulate:
        sweep = ("-g", "cpu", "--compare", "gloo", "-b", "1K", "-e", "64K", "-f", "8",
                 "-n", "3", "-w", "1")
    else:
        sweep = ("-g", "cuda", "--engine", "nccl", "--compare", "nccl", "-b", "8", "-e",
                 "128M", "-f", "4", "-n", "20", "-w", "5")
    job = Job("allreduce", gpus, PERF, ("allreduce", *sweep, "--json", path),
              40.0 if simulate else 75.0, _env(simulate), json=path)
    peer = "torch's gloo group (simulated)" if simulate else "torch's NCCL process group"
    return Check("allreduce", f"ddl-perf allreduce next to {peer}: busbw per size", (job,))


def _train(gpus: int, simulate: bool, out: str) -> Check:
    """A short ResNet-50 run through DDP on the ddl backend, then on torch's NCCL."""
    if simulate:
        model = ("--model", "resnet50", "--width", "8", "--image-size", "32", "--batch", "2",
                 "--device", "cpu", "--steps", "2", "--warmup", "1", "--rounds", "1")
        vias = (("ddp", "ddl"), ("ddp-gloo", "torch"))
    else:
        model = ("--model", "resnet50", "--batch", "32", "--device", "cuda", "--steps", "10",
                 "--warmup", "3", "--rounds", "1")
        vias = (("ddp", "ddl"), ("ddp-nccl", "torch"))
    jobs = []
    for via, who in vias:
        path = os.path.join(out, "raw", f"train-{who}.json")
        jobs.append(Job(f"train-{who}", gpus, PERF, ("train", *model, "--via", via, "--json",
                                                     path),
                        45.0 if simulate else 70.0, _env(simulate), json=path))
    return Check("train", "ResNet-50 training throughput: DDP on the ddl backend against "
                 f"DDP on torch's {'gloo (simulated)' if simulate else 'NCCL'}", tuple(jobs))


def plan(gpus: int, out: str, *, simulate: bool = False, only: tuple[str, ...] = (),
         torch: bool = True) -> list[Check]:
    """Every check for ``gpus`` visible GPUs (or simulated ranks), results under ``out``;
    ``only``: the names to keep (all when empty). ValueError for a name no check has.
    ``torch=False`` (the TensorFlow CUDA image has no torch): only the TensorFlow check
    runs, the others are skipped with that reason."""
    if gpus < 1:
        raise ValueError(f"{gpus} GPUs: gpu-check needs at least one")
    t = 30.0 if simulate else 1.0  # worker deadlines: a CPU job starts slower than it runs
    checks = [
        Check("collectives", "NCCL engine: allreduce, allgather, broadcast, reduce_scatter on "
              "every dtype and odd sizes, against numpy, bitwise equal on every rank",
              (_worker("collectives", gpus, max(t, 60.0), simulate),)),
        _allreduce(gpus, simulate, out),
        Check("ddp", "DDP on the ddl backend bitwise equal to DDP on torch's "
              f"{'gloo (simulated nccl)' if simulate else 'nccl'}",
              (_worker("ddp", gpus, max(t, 45.0), simulate),)),
    ]
    grid = grid_for(gpus)
    if grid is None:
        checks.append(Check("multidim", "multi-dimensional allreduce on device tensors",
                            skip=f"{gpus} GPU(s): a grid of two dimensions of size > 1 needs "
                                 "at least 4 ranks; the one-dimension path is what the "
                                 "collectives check runs"))
    else:
        shape = "x".join(map(str, grid))
        ranks = 1
        for d in grid:
            ranks *= d
        checks.append(Check("multidim", f"multi-dimensional allreduce on device tensors, "
                            f"grid {shape} (DDL_OPTIONS -mode n:{shape}) on one host",
                            (_worker("multidim", ranks, max(t, 45.0), simulate, "--grid", shape,
                                     DDL_OPTIONS=f"-mode n:{shape}",
                                     DDL_CHUNK_BYTES="256K"),)))
    checks += [
        Check("set_device", "torch.cuda.set_device(LOCAL_RANK) under ddlrun: each rank on "
              "its own device, a collective on it", (_worker("set_device", gpus,
                                                            max(t, 30.0), simulate),)),
        # TF tensors never reach the device engine, and DDL_DEVICE_ENGINE=nccl would make
        # ddl refuse to start where torch is missing (the TensorFlow image)
        Check("tensorflow", "TensorFlow GPU tensors through ddl.tensorflow",
              (_worker("tensorflow", gpus, 60.0 if simulate else 50.0, simulate,
                       DDL_DEVICE_ENGINE="host"),)),
        _train(gpus, simulate, out),
    ]
    if gpus == 1:
        alone = ("one rank: ddl makes no device engine for a job of one (there is nothing to "
                 "exchange); NCCL across GPUs needs 2 or more")
        checks = [dataclasses.replace(c, notes=(alone,)) if c.jobs and c.name != "set_device"
                  else c for c in checks]
    if not torch:
        checks = [c if c.name == "tensorflow" or c.skip else
                  Check(c.name, c.title, skip="torch is not installed here (the TensorFlow "
                        "image): this check runs in the torch image") for c in checks]
    if only:
        unknown = sorted(set(only) - {c.name for c in checks})
        if unknown:
            raise ValueError(f"--only {','.join(unknown)}: no such check (the checks: "
                             f"{', '.join(c.name for c in checks)})")
        checks = [c for c in checks if c.name in only]
    return checks


def total_timeout(checks: list[Check]) -> float:
    return sum(c.timeout for c in checks)
