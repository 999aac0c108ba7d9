"""Start N local ranks of a Python program, collect their output, and never leave one
behind. Used by ddl-perf and the tests; jobs across hosts go through ddlrun.

The ranks are a ddlrun job on this host: ``ddlrun.plan.make_plan`` gives them the env
contract (the one copy, names from ``ddlrun.envs``; no DDL_OPTIONS, so the core's default
mode applies), ``ddlrun.backends.local`` starts them in ddlrun's process set and
``ddlrun.run.supervise`` watches them: with ``fail_fast`` (ddl-perf) the first rank that
fails takes the others down at once and its code is the job's; without (the tests, whose
ranks must each report how they saw a peer fail) every rank runs to its end or the timeout.
Ranks run one thread each unless OMP_NUM_THREADS is set: they share the cores.
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddlrun import envs
from ddlrun.backends import LaunchOptions
from ddlrun.backends.local import LocalBackend
from ddlrun.hosts import HostSpec
from ddlrun.output import OutputSink
from ddlrun.plan import JobPlan, Request, make_plan
from ddlrun.preflight import pick_free_pair
from ddlrun.run import TIMEOUT_EXIT, Outcome, supervise
from ddlrun.shm import cleanup, job_secret


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def new_job_id(prefix: str = "job") -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


@dataclass
class JobResult:
    ranks: list[RankResult]
    code: int  # the job's exit code: the first failing rank's (by time), 0 when all passed
    first_failure: int | None  # that rank


class _Discard(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


class _Capture(OutputSink):
    """Every rank's stdout and stderr kept apart, as the rank wrote them (the terminal
    copy is dropped; the sink still keeps the tails ddlrun's report quotes); ddlrun's own
    notes (which rank failed first, what was stopped) go to our stderr."""

    def __init__(self) -> None:
        super().__init__(tag=False, stdout=_Discard(), stderr=_Discard())
        self.text: dict[tuple[int, str], list[str]] = {}

    def line(self, rank: int, stream: str, text: str) -> None:
        with self._lock:
            self.text.setdefault((rank, stream), []).append(text)
        super().line(rank, stream, text)

    def note(self, text: str) -> None:
        print("".join(f"ddl-perf: {ln}\n" for ln in text.splitlines()), end="",
              file=sys.stderr, flush=True)

    def output(self, rank: int, stream: str) -> str:
        with self._lock:
            return "".join(self.text.get((rank, stream), ()))


def local_plan(n: int, argv: Sequence[str], job_id: str, port: int,
               env: Mapping[str, str] | None = None,
               per_rank_env: Sequence[Mapping[str, str]] | None = None) -> JobPlan:
    """The job: ``python argv...`` as ranks 0..n-1 on this host, ddlrun's env contract,
    then ``env`` and each rank's ``per_rank_env`` on top (a test may override any
    variable of the contract)."""
    req = Request(program=(sys.executable, *argv), hosts=(HostSpec("localhost", n),),
                  nproc=n, no_ddloptions=True)
    plan = make_plan(req, {}, job_id, port, os.environ)
    extra = {envs.PYTHONUNBUFFERED: "1", **(env or {})}
    if envs.OMP_NUM_THREADS not in os.environ and envs.OMP_NUM_THREADS not in extra:
        extra[envs.OMP_NUM_THREADS] = "1"
    hosts = []
    for host in plan.hosts:
        ranks = []
        for r in host.ranks:
            mine = {**r.env_dict(), **extra, **(per_rank_env[r.rank] if per_rank_env else {})}
            ranks.append(dataclasses.replace(r, env=tuple(sorted(mine.items()))))
        hosts.append(dataclasses.replace(host, ranks=tuple(ranks)))
    return dataclasses.replace(plan, hosts=tuple(hosts))


def run_job(n: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            per_rank_env: Sequence[Mapping[str, str]] | None = None,
            timeout: float = 120.0, job_id: str | None = None, fail_fast: bool = False,
            grace: float = 5.0) -> JobResult:
    """Run ``python argv...`` as ranks 0..n-1 of one job (see the module docstring).

    On timeout every rank is stopped and a TimeoutError raised. The job's shared memory is
    removed afterwards whatever happened (the local backend's teardown)."""
    plan = local_plan(n, argv, job_id or new_job_id(), pick_free_pair(), env, per_rank_env)
    backend = LocalBackend(LaunchOptions(grace=grace))
    sink = _Capture()
    try:
        outcome: Outcome = supervise(plan, backend, sink, timeout, grace, fail_fast=fail_fast)
    finally:
        # a rank stopped while it made a segment (in init) leaves it: remove the job's own
        secret = job_secret(plan.ranks[0].env_dict()) if plan.ranks else None
        cleanup(plan.job_id, None, secret, note=lambda line: None)
    if outcome.code == TIMEOUT_EXIT and outcome.failure is None and outcome.still_running:
        raise TimeoutError(f"job {plan.job_id}: ranks {list(outcome.still_running)} still "
                           f"running after {timeout:.0f}s")
    codes = backend.procs.codes if backend.procs is not None else {}
    ranks = [RankResult(r, codes.get(r, outcome.code or 127), sink.output(r, "stdout"),
                        sink.output(r, "stderr")) for r in range(n)]
    first = getattr(outcome.failure, "rank", None)
    return JobResult(ranks, outcome.code, first)


def run_local(n: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              per_rank_env: Sequence[Mapping[str, str]] | None = None,
              timeout: float = 120.0, job_id: str | None = None,
              fail_fast: bool = False) -> list[RankResult]:
    """``run_job``'s ranks: every rank's exit code and output."""
    return run_job(n, argv, env=env, per_rank_env=per_rank_env, timeout=timeout,
                   job_id=job_id, fail_fast=fail_fast).ranks
