"""LSF backend: the allocation's hosts (LSB_DJOB_HOSTFILE / LSB_MCPU_HOSTS), one
``blaunch <host> python -m ddlrun.agent`` per host, the same agent protocol as ssh."""

from __future__ import annotations

import shutil

from ..errors import UsageError
from ..hosts import HostSpec
from ..plan import JobPlan
from .ssh import AgentBackend


class LsfBackend(AgentBackend):
    name = "lsf"

    @staticmethod
    def exists() -> bool:
        return shutil.which("blaunch") is not None

    def validate(self, plan: JobPlan) -> None:
        if not self.exists():
            raise UsageError("--launcher lsf: blaunch not found on PATH (run inside an LSF "
                             "job: bsub)")

    def transport(self, host: HostSpec, connect_timeout: float | None = None) -> list[str]:
        return ["blaunch", "-no-shell", host.name]

    def fix_hint(self, host: HostSpec) -> str:
        return f"check that `blaunch {host.name} true` works inside this LSF job"
