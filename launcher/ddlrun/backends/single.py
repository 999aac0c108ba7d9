"""Shared run logic for launchers that are one process for the whole job (mpirun, srun):
the layout goes to ``ddlrun.rankenv`` through the launcher's own environment (exported by
name only), and the launcher's exit code is the job's.

Failure records: at start ddlrun makes a private folder for them on its own host
(``DDLRUN_ERROR_DIR``); ``ddlrun.rankenv`` gives each rank a ``DDL_ERROR_FILE`` there where
the folder exists on the rank's host (ddlrun's own host, or a shared filesystem), and
``records()`` reads what the ranks left once the launcher has exited."""

from __future__ import annotations

import os
import shlex
from glob import glob

from .. import envs
from ..events import Emit, JobExit, StartFailed
from ..failures import FailureRecord, RecordFolder, read_record
from ..output import OutputSink
from ..plan import JobPlan
from ..procs import Exit, ProcessSet, ProcSpec
from .base import Backend

RANKENV = ("-m", "ddlrun.rankenv", "--")


class SingleLauncherBackend(Backend):
    notes_own_command = True
    procs: ProcessSet | None = None
    plan: JobPlan | None = None
    record_folder: RecordFolder | None = None  # made by start (open_records)

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
        if self.record_folder is not None:
            env[envs.DDLRUN_ERROR_DIR] = self.record_folder.folder
        return env

    def open_records(self, plan: JobPlan) -> None:
        """Make the job's folder of failure records (before the command is built)."""
        self.record_folder = RecordFolder(plan.job_id)

    def records(self) -> dict[int, FailureRecord]:
        folder = self.record_folder
        if folder is None:
            return {}
        found = {}
        for path in glob(os.path.join(folder.folder, "rank-*.json")):
            rank = os.path.basename(path)[len("rank-"):-len(".json")]
            record = read_record(path)
            if rank.isdigit() and record is not None:
                found[int(rank)] = record
        return found

    def watch(self, stream: str, text: str, sink: OutputSink) -> None:
        """Sees every line of the launcher's output before it is passed on."""

    def job_code(self, code: int) -> int:
        """The job's exit code, from the launcher's."""
        return code

    def start(self, plan: JobPlan, sink: OutputSink, emit: Emit) -> None:
        self.open_records(plan)
        self.launch(plan, self.get_cmd(plan), sink, emit)

    def launch(self, plan: JobPlan, argv: list[str], sink: OutputSink, emit: Emit) -> None:
        """Run the launcher's ``argv`` for the plan (its one process)."""
        self.plan = plan

        def on_exit(ex: Exit) -> None:
            if ex.error is not None:  # the launcher (mpirun, srun) could not be exec'd
                emit(StartFailed(ex.error.filename, ex.error.strerror, ex.time))
            else:
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
        if self.record_folder is not None:
            self.record_folder.remove()
        # the job's segments: steps.act cleans this host with the job's secret
