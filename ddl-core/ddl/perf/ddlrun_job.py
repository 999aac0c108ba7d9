"""ddl-perf's own jobs (``allreduce --ranks``, ``scale``) as ddlrun subprocesses (or
horovodrun ones, for ``scale --via horovod``), their output streamed line by line as rank 0
prints it.

ddlrun gets the deadline itself (``--timeout``), so a job that overruns is taken down by
ddlrun's own teardown (SIGTERM to every rank, grace, SIGKILL, its shared memory removed)
and ddlrun names the ranks still running. A ddlrun that does not end by then either (it is
stuck itself) gets SIGTERM, then SIGKILL: reading the job's output never outlives the
deadline, even when the job prints nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TIMEOUT_EXIT = 124  # ddlrun's exit code when --timeout ran out
# How long after its own deadline ddlrun may take to tear the job down (its grace is 5 s)
# before it counts as stuck.
_TEARDOWN_S = 30.0
_KILL_AFTER_S = 10.0


def ddlrun_argv(ranks: int, program: Sequence[str], timeout: float,
                ddlrun_args: Sequence[str] = ()) -> list[str]:
    """``python -m ddlrun -n N --timeout T ... python -m ddl.perf.cli PROGRAM...`` as argv
    (never a shell line)."""
    return [sys.executable, "-m", "ddlrun", "-n", str(ranks), "--no-tag-output",
            "--timeout", f"{timeout:g}", *ddlrun_args,
            sys.executable, "-m", "ddl.perf.cli", *program]


@dataclass(frozen=True)
class Launch:
    """Who starts one of ddl-perf's jobs, and where: ddlrun (default), or Horovod's own
    horovodrun for ``--via horovod`` (from ``horovod_venv``, else from this environment).
    ``hosts``/``hostfile`` are spelled alike by both (``-H h1:2,h2:2``); ``extra`` is passed
    to the launcher as given (argv items, never a shell line)."""

    hosts: str | None = None
    hostfile: str | None = None
    extra: tuple[str, ...] = ()
    horovod: bool = False
    horovod_venv: str | None = None

    def name(self) -> str:
        return "horovodrun" if self.horovod else "ddlrun"

    def where(self) -> list[str]:
        return ((["-H", self.hosts] if self.hosts else [])
                + (["--hostfile", self.hostfile] if self.hostfile else []))

    def argv(self, ranks: int, program: Sequence[str], timeout: float) -> list[str]:
        where = self.where()
        if not self.horovod:
            return ddlrun_argv(ranks, program, timeout, [*where, *self.extra])
        bindir = (os.path.join(os.path.abspath(self.horovod_venv), "bin")
                  if self.horovod_venv else os.path.dirname(sys.executable))
        return [os.path.join(bindir, "horovodrun"), "-np", str(ranks),
                *(where or ["-H", f"localhost:{ranks}"]), "--gloo", *self.extra,
                os.path.join(bindir, "python"), "-m", "ddl.perf.cli", *program]

    def env(self) -> dict[str, str] | None:
        """What a horovodrun job needs beyond this environment (None for ddlrun's, which
        makes it all): with a Horovod venv, this ddl (and ddlrun) first on its PYTHONPATH;
        and ddl's own rendezvous, since horovodrun gives Horovod's only: host 0 of -H (else
        this host), a port free here, a job id and a secret, each unless already set."""
        if not self.horovod:
            return None
        import secrets

        import ddl
        import ddlrun
        from ddlrun.preflight import pick_free_pair

        out = dict(os.environ)
        if self.horovod_venv:
            roots = [os.path.dirname(os.path.dirname(os.path.abspath(m.__file__)))
                     for m in (ddl, ddlrun)]
            path = [*dict.fromkeys(roots), *filter(None, [os.environ.get("PYTHONPATH")])]
            out["PYTHONPATH"] = os.pathsep.join(path)
        out.setdefault("MASTER_ADDR", self.hosts.split(",")[0].split(":")[0] if self.hosts
                       else "127.0.0.1")
        out.setdefault("MASTER_PORT", str(pick_free_pair()))
        out.setdefault("DDL_JOB_ID", f"perf_{secrets.token_hex(6)}")
        if not (out.get("DDL_JOB_SECRET") or out.get("DDL_JOB_SECRET_FILE")):
            out["DDL_JOB_SECRET"] = secrets.token_hex(16)
        return out

    def clean(self, line: str) -> str:
        """A line of the job's output without horovodrun's ``[0]<stdout>:`` tag."""
        return _HOROVODRUN_TAG.sub("", line, count=1) if self.horovod else line

    def check(self) -> None:
        """A missing horovodrun is a ValueError before any job starts."""
        if self.horovod:
            tool = self.argv(1, [], 0)[0]
            if not os.access(tool, os.X_OK):
                where = (f"--horovod {self.horovod_venv}" if self.horovod_venv
                         else "this environment")
                raise ValueError(f"horovod: no horovodrun in {where} ({tool}); give "
                                 "--horovod VENV, a virtualenv with Horovod for its torch "
                                 "(benchmarks/build_horovod.sh builds one)")
            if self.hostfile and not os.environ.get("MASTER_ADDR"):
                raise ValueError("horovod with --hostfile: set MASTER_ADDR to the first "
                                 "host's address (ddl's rendezvous in a horovodrun job)")
        elif self.horovod_venv:
            raise ValueError("--horovod VENV is for --via horovod or --compare horovod")


DDLRUN = Launch()  # ddlrun on this host: the default


def horovod_can_join(environ: Mapping[str, str]) -> bool:
    """Whether Horovod's init can find its peers here: a job of horovodrun (its Gloo
    rendezvous) or of mpirun (an MPI build). Under ddlrun, whose HOROVOD_RANK/SIZE it
    reads, Horovod waits 30 s for a store nobody runs and aborts the process."""
    return bool(environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
                or environ.get("OMPI_COMM_WORLD_SIZE"))
_HOROVODRUN_TAG = re.compile(r"^\[\d+\]<std(?:out|err)>:")


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that say where ddl-perf's own jobs run (allreduce --ranks, scale)."""
    p.add_argument("--horovod", metavar="VENV",
                   help="for Horovod itself (--via horovod, --compare horovod): a virtualenv "
                        "with Horovod for its torch, whose horovodrun starts the jobs "
                        "(default: this environment's)")
    p.add_argument("-H", "--hosts", metavar="HOST[:SLOTS],...",
                   help="hosts of each job, passed to its launcher (ddlrun, horovodrun)")
    p.add_argument("--hostfile", metavar="FILE", help="hostfile of each job, as -H")
    p.add_argument("--launcher-arg", dest="launcher_args", action="append", default=[],
                   metavar="ARG", help="one more argument for the launcher (repeatable), "
                                       "e.g. --launcher-arg=--ssh-port=2222")


def launch_from_args(args: argparse.Namespace) -> Launch:
    """horovodrun for ``--via horovod`` or ``--compare ...,horovod``, else ddlrun."""
    horovod = (getattr(args, "via", None) == "horovod"
               or "horovod" in getattr(args, "compare", "").split(","))
    return Launch(hosts=args.hosts, hostfile=args.hostfile, extra=tuple(args.launcher_args),
                  horovod=horovod, horovod_venv=args.horovod)


def stream(argv: Sequence[str], timeout: float, on_line: Callable[[str], None], *,
           merge_stderr: bool = False, start: Callable[..., Any] = subprocess.Popen,
           teardown: float = _TEARDOWN_S, kill_after: float = _KILL_AFTER_S) -> int:
    """Run ``argv`` (a ddlrun command made by :func:`ddlrun_argv`), calling ``on_line`` for
    every line it prints; its exit code, or TIMEOUT_EXIT when it had to be stopped from here
    (SIGTERM ``teardown`` seconds after ``timeout``, SIGKILL ``kill_after`` seconds later).
    ``start``: the process starter (a seam for tests)."""
    stopped = threading.Event()
    with start(argv, stdout=subprocess.PIPE,
               stderr=subprocess.STDOUT if merge_stderr else None, text=True,
               bufsize=1) as proc:

        def stop(sig_kill: bool) -> None:
            if proc.poll() is None:
                stopped.set()
                proc.kill() if sig_kill else proc.terminate()

        term = threading.Timer(timeout + teardown, stop, (False,))
        kill = threading.Timer(timeout + teardown + kill_after, stop, (True,))
        for t in (term, kill):
            t.daemon = True
            t.start()
        try:
            for line in proc.stdout:
                on_line(line)
            code = proc.wait()
        finally:
            term.cancel()
            kill.cancel()
    return TIMEOUT_EXIT if stopped.is_set() else code
