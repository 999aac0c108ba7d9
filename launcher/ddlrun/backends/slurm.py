"""Slurm backend: one ``srun`` inside the allocation, block distribution (host by host, as
the plan places ranks), ``--kill-on-bad-exit`` for fail-fast, every rank wrapped in
``python -m ddlrun.rankenv``. Env values travel in srun's environment (``--export=ALL``)."""

from __future__ import annotations

import shutil

from ..errors import UsageError
from ..plan import JobPlan
from .single import SingleLauncherBackend


class SlurmBackend(SingleLauncherBackend):
    name = "slurm"

    @staticmethod
    def exists() -> bool:
        return shutil.which("srun") is not None

    def validate(self, plan: JobPlan) -> None:
        if not self.exists():
            raise UsageError("--launcher slurm: srun not found on PATH (run inside an "
                             "allocation: salloc / sbatch)")

    def get_cmd(self, plan: JobPlan) -> list[str]:
        counts = {len(h.ranks) for h in plan.hosts}
        argv = ["srun", f"--nodes={len(plan.hosts)}", f"--ntasks={plan.world_size}",
                "--nodelist=" + ",".join(h.host.name for h in plan.hosts),
                "--distribution=block", "--kill-on-bad-exit=1", "--export=ALL",
                "--cpu-bind=none"]
        if len(counts) == 1:
            argv.append(f"--ntasks-per-node={counts.pop()}")
        if self.opts.tag_output:
            argv.append("--label")
        argv += list(self.opts.mpiargs)
        return argv + self.rank_command(plan)
