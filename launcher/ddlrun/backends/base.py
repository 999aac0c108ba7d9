"""What every backend shares: ``LaunchOptions`` (the command line's knobs), the
``Backend`` base class, the check of paths handed to ssh or mpirun and the ssh options
the ssh and mpirun backends both give ssh (``ssh_options``)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ..errors import UsageError
from ..events import Emit, Stuck
from ..failures import FailureRecord
from ..output import OutputSink
from ..plan import JobPlan


@dataclass(frozen=True)
class LaunchOptions:
    """Backend knobs from the command line (all optional)."""

    ssh_port: int | None = None
    ssh_identity: str | None = None
    ssh_config: str | None = None
    remote_python: str = sys.executable
    start_timeout: float = 30.0
    grace: float = 5.0
    mpiargs: tuple[str, ...] = ()
    tcp: bool = False
    network_interface: str | None = None
    tag_output: bool = True
    is_root: bool = False
    rankfile_path: str | None = None  # the user's --rankfile (absolute)
    cwd: str | None = None


class Backend:
    name = ""
    notes_own_command = False  # prints "running: ..." itself (after writing its files)
    # seconds the supervisor keeps listening after the first failure it hears of: an exit
    # that happened earlier may be reported later (another host, a busy output pipe)
    settle = 0.25

    def __init__(self, opts: LaunchOptions) -> None:
        self.opts = opts

    @staticmethod
    def exists() -> bool:
        return True

    def validate(self, plan: JobPlan) -> None:
        """Raise UsageError when this backend cannot run the plan."""

    def commands(self, plan: JobPlan) -> list[list[str]]:
        """Every command this backend would run, for --dry-run."""
        raise NotImplementedError

    def plan_notes(self, plan: JobPlan) -> list[str]:
        """What else the run will use, for --dry-run (the mpirun rankfile); none by
        default."""
        return []

    def start(self, plan: JobPlan, sink: OutputSink, emit: Emit) -> None:
        raise NotImplementedError

    def close(self, timeout: float) -> None:
        raise NotImplementedError

    def stuck(self, timeout: float) -> list[Stuck]:
        """Ranks still running that are stopped (asked before teardown); none by default."""
        return []

    def wait_output(self, rank: int, timeout: float) -> None:
        """Wait, at most ``timeout``, until a rank's output has all arrived."""

    def pids(self) -> dict[int, int]:
        """The running ranks' pids on ddlrun's own host, by rank (those it can signal to
        ask for their flight recorder); none by default."""
        return {}

    def records(self) -> dict[int, FailureRecord]:
        """Failure records by rank that came apart from the ranks' exits (mpirun, srun:
        read after the job); the other backends attach each to its ``RankExit``."""
        return {}


def check_path(value: str, what: str) -> str:
    """Paths handed to ssh/mpirun: no whitespace or control characters, no leading '-'."""
    if not value or value.startswith("-") or any(c.isspace() or ord(c) < 32 for c in value):
        raise UsageError(f"{what} {value!r}: paths must not start with '-' or contain spaces")
    return value


def ssh_options(opts: LaunchOptions) -> list[str]:
    """The user's ssh options (``--ssh-config``, ``--ssh-port``, ``--ssh-identity``) as
    ssh's own flags: the ssh backend puts them in each ssh command, the mpirun backend
    hands them to Open MPI's ssh (``plm_ssh_args``)."""
    argv: list[str] = []
    if opts.ssh_config:
        argv += ["-F", check_path(opts.ssh_config, "--ssh-config")]
    if opts.ssh_port:
        argv += ["-p", str(int(opts.ssh_port))]
    if opts.ssh_identity:
        argv += ["-i", check_path(opts.ssh_identity, "--ssh-identity")]
    return argv


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0
