"""Local backend: every rank a child process of ddlrun on this host."""

from __future__ import annotations

import os

from ..events import Emit, RankExit, Stuck
from ..output import OutputSink
from ..plan import JobPlan, RankSpec
from ..procs import Exit, ProcessSet, ProcSpec
from ..shm import cleanup
from . import Backend


class LocalBackend(Backend):
    name = "local"
    procs: ProcessSet | None = None
    plan: JobPlan | None = None

    def get_cmd(self, rank: RankSpec) -> list[str]:
        return list(rank.argv)

    def commands(self, plan: JobPlan) -> list[list[str]]:
        return [self.get_cmd(r) for r in plan.ranks]

    def start(self, plan: JobPlan, sink: OutputSink, emit: Emit) -> None:
        self.plan = plan
        by_rank = {r.rank: r for r in plan.ranks}

        def on_exit(ex: Exit) -> None:
            emit(RankExit(ex.key, by_rank[ex.key].host_index, ex.code, ex.pid, ex.time))

        self.procs = ProcessSet(sink.line, on_exit)
        base = dict(os.environ)
        self.procs.start(
            ProcSpec(r.rank, tuple(self.get_cmd(r)), {**base, **r.env_dict()}, self.opts.cwd)
            for r in plan.ranks
        )

    def stuck(self, timeout: float) -> list[Stuck]:
        if self.procs is None or self.plan is None:
            return []
        host_of = {r.rank: r.host_index for r in self.plan.ranks}
        return [Stuck(rank, host_of[rank], pid, state)
                for rank, (pid, state) in sorted(self.procs.stuck().items())]

    def wait_output(self, rank: int, timeout: float) -> None:
        if self.procs is not None:
            self.procs.wait_output(rank, timeout)

    def pids(self) -> dict[int, int]:
        return {k: p.pid for k, p in self.procs.procs.items()} if self.procs else {}

    def close(self, timeout: float) -> None:
        if self.procs is not None:
            self.procs.close(timeout=timeout)
        if self.plan is not None:
            for h in self.plan.hosts:
                cleanup(self.plan.job_id, h.index)
