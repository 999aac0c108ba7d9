"""Local backend: every rank a child process of ddlrun on this host; each rank's failure
record (failures.py) is read when it exits."""

from __future__ import annotations

import os

from .. import envs
from ..diagnose import flight_folder, tidy
from ..events import Emit, RankExit, StartFailed, Stuck
from ..failures import RecordFolder, read_record
from ..output import OutputSink
from ..plan import JobPlan, RankSpec
from ..procs import Exit, ProcessSet, ProcSpec
from .base import Backend


class LocalBackend(Backend):
    name = "local"
    procs: ProcessSet | None = None
    plan: JobPlan | None = None
    records: RecordFolder | None = None

    def get_cmd(self, rank: RankSpec) -> list[str]:
        return list(rank.argv)

    def commands(self, plan: JobPlan) -> list[list[str]]:
        return [self.get_cmd(r) for r in plan.ranks]

    def start(self, plan: JobPlan, sink: OutputSink, emit: Emit) -> None:
        self.plan = plan
        by_rank = {r.rank: r for r in plan.ranks}
        records = self.records = RecordFolder(plan.job_id)
        base = dict(os.environ)
        # the rank's env from the plan (-x, a test's override) may name its own record file
        flight = flight_folder(plan.job_id)
        env_of = {r.rank: {**base, envs.DDL_ERROR_FILE: records.path(r.rank),
                           envs.DDL_FLIGHT_DIR: flight, **r.env_dict()}
                  for r in plan.ranks}

        def on_exit(ex: Exit) -> None:
            if ex.error is not None:  # its program could not be exec'd
                emit(StartFailed(ex.error.filename, ex.error.strerror, ex.time))
                return
            path = env_of[ex.key][envs.DDL_ERROR_FILE]
            record = read_record(path) if ex.code != 0 else None
            emit(RankExit(ex.key, by_rank[ex.key].host_index, ex.code, ex.pid, ex.time,
                          record))

        self.procs = ProcessSet(sink.line, on_exit)
        self.procs.start(
            ProcSpec(r.rank, tuple(self.get_cmd(r)), env_of[r.rank], self.opts.cwd)
            for r in plan.ranks
        )

    def stuck(self, timeout: float) -> list[Stuck]:
        if self.procs is None or self.plan is None:
            return []
        host_of = {r.rank: r.host_index for r in self.plan.ranks}
        return [Stuck(rank, host_of[rank], s.pid, s.state, s.starting)
                for rank, s in sorted(self.procs.stuck().items())]

    def wait_output(self, rank: int, timeout: float) -> None:
        if self.procs is not None:
            self.procs.wait_output(rank, timeout)

    def pids(self) -> dict[int, int]:
        if self.procs is None:
            return {}
        running = set(self.procs.running())
        return {k: p.pid for k, p in self.procs.procs.items() if k in running}

    def close(self, timeout: float) -> None:
        if self.procs is not None:
            self.procs.close(timeout=timeout)
        if self.records is not None:
            self.records.remove()
        if self.plan is not None:
            tidy(flight_folder(self.plan.job_id))
        # the job's segments: steps.act cleans this host with the job's secret
