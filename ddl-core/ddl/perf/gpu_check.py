"""``ddl-perf gpu-check`` (``make gpu-check``): one command that proves ddl's GPU path on a
machine with 1-8 NVIDIA GPUs in under 8 minutes, and writes one report (docs/gpu-check.md).

Three steps, apart: the plan (``gpu_check_plan``: which checks, ranks, sizes, deadlines),
running it (here: each job a ddlrun subprocess with its own deadline, so a hang or a crash
is that check failing, with its last lines, and the next check still runs), and the report
(``gpu_check_report``: markdown and JSON from the list of results). What a job's output
means (the result line of a check worker, ddl-perf's ``--json`` documents) is read by the
pure ``result_*`` functions below.

Without a CUDA GPU it prints one line and exits 0, having run nothing. ``--simulate-cpu N``
(hidden; the tests') runs every check's code on N CPU ranks instead: ddl's device engine
over Gloo, torch's Gloo group for its NCCL one, tiny sizes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import gpu_check_plan as planmod
from .ddlrun_job import TIMEOUT_EXIT, stream
from .gpu_check_plan import MARK, Check, Job
from .gpu_check_report import FAIL, PASS, SKIP, Result, exit_code, render_markdown, to_json

TAIL_LINES = 30  # of a failed job's output, in the report
# the caller's job, if any, is not the checks' job: ddlrun makes their rank variables
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "DDL_JOB_ID", "DDL_OPTIONS")


@dataclass(frozen=True)
class Outcome:
    """What one job did: exit code (TIMEOUT_EXIT when stopped at its deadline), the
    check worker's result line (None if it printed none), the last lines, its seconds."""

    job: Job
    code: int
    result: dict | None
    tail: tuple[str, ...]
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.code == TIMEOUT_EXIT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="gpu-check", metavar="DIR",
                   help="where the report goes: DIR/gpu-check.md, DIR/gpu-check.json, and "
                        "ddl-perf's own JSON under DIR/raw (default: ./gpu-check)")
    p.add_argument("--only", default="", metavar="CHECK,...",
                   help="run only these checks (collectives, allreduce, ddp, multidim, "
                        "set_device, tensorflow, train)")
    p.add_argument("--simulate-cpu", type=int, default=0, metavar="N", help=argparse.SUPPRESS)


# ------------------------------------------------------------------- running (impure)
def job_argv(job: Job) -> list[str]:
    """``python -m ddlrun -n N --timeout T python -m MODULE ARGS`` (argv, no shell)."""
    return [sys.executable, "-m", "ddlrun", "-n", str(job.ranks), "--no-tag-output",
            "--timeout", f"{job.timeout:g}", sys.executable, "-m", job.module, *job.args]


def job_env(job: Job, simulate: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env.update(job.env)
    if simulate:  # CPU ranks share the cores: one torch thread each
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_job(job: Job, simulate: bool) -> Outcome:
    """One job through ddlrun, its output kept (the last lines) and scanned for the result
    line; ddlrun enforces the deadline, ``stream`` stops a ddlrun that outlives it."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    found: list[dict] = []

    def on_line(line: str) -> None:
        line = line.rstrip("\n")
        if line.startswith(MARK):
            found.append(json.loads(line[len(MARK):]))
        else:
            tail.append(line)

    start = time.monotonic()
    try:
        code = stream(job_argv(job), job.timeout, on_line, merge_stderr=True,
                      start=functools.partial(subprocess.Popen, env=job_env(job, simulate)))
    except OSError as exc:
        code = 127
        tail.append(f"gpu-check: could not start ddlrun: {exc}")
    return Outcome(job, code, found[-1] if found else None, tuple(tail),
                   time.monotonic() - start)


Runner = Callable[[Job, bool], Outcome]


def run_checks(checks: Sequence[Check], simulate: bool, runner: Runner = run_job,
               progress: Callable[[str], None] = print) -> list[Result]:
    """Every check in order, each job through ``runner`` (a seam for tests); a check that
    fails does not stop the next."""
    results = []
    for check in checks:
        if check.skip:
            result = Result(check.name, check.title, SKIP, check.skip)
        else:
            progress(f"# gpu-check: {check.name}: {len(check.jobs)} job(s), "
                     f"{check.jobs[0].ranks} rank(s), at most {check.timeout:g} s")
            result = interpret(check, [runner(job, simulate) for job in check.jobs])
            if check.notes:
                result = dataclasses.replace(result, details=(*result.details, *check.notes))
        progress(f"# gpu-check: {check.name}: {result.status.upper()} ({result.seconds:.1f} "
                 f"s): {result.summary}")
        results.append(result)
    return results


# ------------------------------------------------------------ reading results (pure)
def _failed_job(check: Check, o: Outcome, seconds: float) -> Result:
    why = (f"timed out after {o.job.timeout:g} s" if o.timed_out
           else f"exited with code {o.code}")
    return Result(check.name, check.title, FAIL, f"job {o.job.name} {why}", seconds,
                  tail=o.tail)


def _load(path: str | None) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def result_of_worker(check: Check, o: Outcome) -> Result:
    """A check worker's result line; no line (a crash, a hang) or a non-zero exit after a
    pass or a skip (rank 0 skipped, another rank went on and hung) is a failure, shown with
    the job's last lines."""
    doc = o.result
    if doc is None or (doc["status"] != FAIL and o.code != 0):
        return _failed_job(check, o, o.seconds)
    return Result(check.name, check.title, doc["status"], doc["summary"], o.seconds,
                  tuple(doc.get("columns", ())), tuple(tuple(r) for r in doc.get("rows", ())),
                  tuple(doc.get("details", ())),
                  o.tail if doc["status"] == FAIL else ())


def result_of_allreduce(check: Check, o: Outcome, doc: dict | None) -> Result:
    """ddl-perf allreduce --compare's JSON: busbw per size for ddl and the peer, out of
    place, and their ratio (> 1: ddl faster)."""
    if o.code != 0 or doc is None:
        return _failed_job(check, o, o.seconds)
    engines = doc["config"]["engines"]
    ours, peer = engines[0], engines[-1]
    by: dict[int, dict[str, dict]] = collections.defaultdict(dict)
    for row in doc["results"]:
        by[row["size"]][row["engine"]] = row
    rows = []
    for size in sorted(by):
        a, b = by[size][ours]["out_of_place"], by[size][peer]["out_of_place"]
        ratio = f"{a['bus_bw'] / b['bus_bw']:.2f}" if b["bus_bw"] > 0 else "-"
        rows.append((str(size), f"{a['bus_bw']:.2f}", f"{b['bus_bw']:.2f}", ratio,
                     str((a["nwrong"] or 0) + (b["nwrong"] or 0))))
    avg = doc["average_bus_bandwidth"]["by_engine"]
    wrong = doc["out_of_bounds"]["count"]
    summary = (f"average busbw {ours} {avg[ours]:.2f} GB/s, {peer} {avg[peer]:.2f} GB/s over "
               f"{len(rows)} sizes, {doc['config']['nranks']} ranks; {wrong} wrong")
    return Result(check.name, check.title, FAIL if wrong else PASS, summary, o.seconds,
                  ("size (B)", f"{ours} busbw (GB/s)", f"{peer} busbw (GB/s)",
                   f"{ours}/{peer} busbw", "#wrong"), tuple(rows),
                  (f"{doc['config']['datatype']} {doc['config']['op']}, busbw ratio > 1: "
                   f"{ours} faster; "
                   f"{doc['config']['iterations']} iterations, out of place; device "
                   f"{doc['config']['device']}", *doc.get("devices", ())[:8]))


def result_of_train(check: Check, outcomes: Sequence[Outcome],
                    docs: Sequence[dict | None]) -> Result:
    """Two ddl-perf train documents, ddl's first: throughput side by side and the ratio."""
    seconds = sum(o.seconds for o in outcomes)
    for o, doc in zip(outcomes, docs):
        if o.code != 0 or doc is None:
            return _failed_job(check, o, seconds)
    rows = [(d["via"], f"{d['throughput']['total']:.1f}", f"{d['throughput']['per_rank']:.1f}",
             f"{d['step_s'] * 1e3:.1f}", f"{100 * d['shares']['comm']:.1f}") for d in docs]
    ours, peer = docs[0], docs[-1]
    ratio = ours["throughput"]["total"] / peer["throughput"]["total"]
    unit = ours["unit"]
    summary = (f"{ours['throughput']['total']:.1f} {unit}/s through ddl, "
               f"{peer['throughput']['total']:.1f} through {peer['via']} "
               f"(ddl/{peer['via']} = {ratio:.2f}), {ours['ranks']} ranks")
    return Result(check.name, check.title, PASS, summary, seconds,
                  ("via", f"{unit}/s (total)", f"{unit}/s per rank", "step ms",
                   "exposed comm %"), tuple(rows),
                  (f"{ours['describe']}, batch {ours['batch']} per rank, {ours['precision']}, "
                   f"{ours['steps']} timed steps; {ours['device']}",))


def interpret(check: Check, outcomes: Sequence[Outcome]) -> Result:
    if check.name == "allreduce":
        return result_of_allreduce(check, outcomes[0], _load(outcomes[0].job.json))
    if check.name == "train":
        return result_of_train(check, outcomes, [_load(o.job.json) for o in outcomes])
    return result_of_worker(check, outcomes[0])


# ---------------------------------------------------------------------------- CLI
def visible_gpus() -> tuple[int, str]:
    """(CUDA GPUs torch sees, why none when 0); where torch is missing (the TensorFlow
    image), the GPUs TensorFlow sees, so its check runs there."""
    try:
        import torch
    except ImportError:
        return _tensorflow_gpus()
    count = torch.cuda.device_count()
    return count, "" if count else "torch.cuda.device_count() == 0"


def _tensorflow_gpus() -> tuple[int, str]:
    try:
        import tensorflow as tf
    except ImportError:
        return 0, "neither torch nor TensorFlow is installed"
    count = len(tf.config.list_physical_devices("GPU"))
    return count, "" if count else (f"torch is not installed; TensorFlow {tf.__version__} "
                                    "sees no GPU")


def _meta(gpus: int, simulate: bool, seconds: float) -> dict[str, str]:
    from .. import __version__

    meta = {"host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "ddl": __version__, "python": platform.python_version()}
    try:
        import torch

        meta["torch"] = torch.__version__
        if not simulate:
            meta["cuda"] = str(torch.version.cuda)
            nccl = torch.cuda.nccl.version()  # a tuple in torch 2, an int before
            meta["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
            names = collections.Counter(torch.cuda.get_device_name(i) for i in range(gpus))
            meta["gpus"] = ", ".join(f"{n} x {name}" for name, n in names.items())
    except Exception as exc:  # the report is still written when a version cannot be read
        meta["versions"] = f"not all read: {exc}"
    meta["ranks"] = (f"{gpus} simulated on CPU (DDL_DEVICE_ENGINE=gloo, torch's gloo for "
                     f"nccl)" if simulate else f"{gpus} (one per GPU)")
    meta["time"] = f"{seconds:.0f} s"
    return meta


def gpu_check_main(args: argparse.Namespace, runner: Runner = run_job) -> int:
    simulate = args.simulate_cpu > 0
    gpus, why = (args.simulate_cpu, "") if simulate else visible_gpus()
    if gpus == 0:
        print(f"gpu-check: no CUDA GPU visible ({why}); nothing run")
        return 0
    only = tuple(n for n in args.only.split(",") if n)
    try:
        checks = planmod.plan(gpus, args.out, simulate=simulate, only=only,
                              torch=importlib.util.find_spec("torch") is not None)
    except ValueError as exc:
        print(f"ddl-perf gpu-check: {exc}", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(args.out, "raw"), exist_ok=True)
    start = time.monotonic()
    results = run_checks(checks, simulate, runner)
    meta = _meta(gpus, simulate, time.monotonic() - start)
    markdown = render_markdown(results, meta)
    with open(os.path.join(args.out, "gpu-check.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(args.out, "gpu-check.json"), "w") as f:
        f.write(to_json(results, meta))
    print(markdown, end="")
    print(f"# gpu-check: report written to {os.path.join(args.out, 'gpu-check.md')} "
          "and gpu-check.json")
    return exit_code(results)
