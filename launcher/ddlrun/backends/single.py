"""Shared run logic for launchers that are one process for the whole job (mpirun, srun):
the layout goes to ``ddlrun.rankenv`` through the launcher's own environment (exported by
name only), and the launcher's exit code is the job's."""

from __future__ import annotations

import os
import shlex

from .. import envs
from ..events import Emit, JobExit
from ..output import OutputSink
from ..plan import JobPlan
from ..procs import Exit, ProcessSet, ProcSpec
from ..shm import cleanup
from . import Backend

RANKENV = ("-m", "ddlrun.rankenv", "--")


class SingleLauncherBackend(Backend):
    notes_own_command = True
    procs: ProcessSet | None = None
    plan: JobPlan | None = None

    def get_cmd(self, plan: JobPlan) -> list[str]:
        raise NotImplementedError

    def commands(self, plan: JobPlan) -> list[list[str]]:
        return [self.get_cmd(plan)]

    def rank_command(self, plan: JobPlan) -> list[str]:
        return [self.opts.remote_python, *RANKENV, *plan.program]

    def job_env(self, plan: JobPlan) -> dict[str, str]:
        """The env every rank shares, plus the layout for ddlrun.rankenv."""
        env = dict(plan.common_env)
        env[envs.DDLRUN_RANK_HOSTS] = ",".join(str(h) for h in plan.layout)
        env[envs.DDLRUN_HOST_GPUS] = ";".join(h.gpus.encode() for h in plan.hosts)
        return env

    def watch(self, stream: str, text: str, sink: OutputSink) -> None:
        """Sees every line of the launcher's output before it is passed on."""

    def job_code(self, code: int) -> int:
        """The job's exit code, from the launcher's."""
        return code

    def start(self, plan: JobPlan, sink: OutputSink, emit: Emit) -> None:
        self.launch(plan, self.get_cmd(plan), sink, emit)

    def launch(self, plan: JobPlan, argv: list[str], sink: OutputSink, emit: Emit) -> None:
        """Run the launcher's ``argv`` for the plan (its one process)."""
        self.plan = plan

        def on_exit(ex: Exit) -> None:
            emit(JobExit(self.job_code(ex.code), ex.time))

        def on_line(key: int, stream: str, text: str) -> None:
            self.watch(stream, text, sink)
            sink.raw(stream, text)  # the launcher tags ranks itself (see get_cmd)

        self.procs = ProcessSet(on_line, on_exit)
        env = {**os.environ, **self.job_env(plan)}
        sink.note("running: " + shlex.join(argv))
        self.procs.start([ProcSpec(0, tuple(argv), env, self.opts.cwd)])

    def close(self, timeout: float) -> None:
        if self.procs is not None:
            self.procs.close(timeout=timeout)
        if self.plan is not None:
            # Only this host's segments can be reached from here; ranks clean their own.
            for h in self.plan.hosts:
                cleanup(self.plan.job_id, h.index)
