"""The steps of a run after the command line: ``preflight()`` (probe the hosts),
``job_inputs()`` (draw the job id, the port and the secret: the side effects planning
needs), ``plan_job()`` (pure: ``plan.make_plan``), ``act()`` (print the plan for --dry-run,
or run it under ``run.supervise``), and the modes that run no job (--cleanup).
Side effects live here and in the backends, never in the planner.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import envs
from .backends import Backend
from .backends.ssh import AgentBackend, SshBackend
from .errors import PreflightError
from .hosts import HostSpec, is_local
from .output import OutputSink, log_paths
from .plan import HostFacts, JobPlan, Request, describe, make_plan, validate_job_id
from .preflight import (
    ProbeResult,
    check,
    facts_from_probe,
    pick_free_pair,
    probe,
    probe_all,
    probe_remote,
    version_table,
)
from .run import signals_raise, supervise
from .shm import cleanup, mib, sweep_orphans

if TYPE_CHECKING:
    from .cli import Config

PYTHON_NAME = re.compile(r"^python[0-9.]*$")


def is_python(program: str) -> bool:
    """Whether the program is a python interpreter (``python``, ``python3.11``, a path)."""
    return bool(PYTHON_NAME.match(os.path.basename(program)))


def new_job_id() -> str:
    return f"{time.strftime('%Y%m%d%H%M%S')}_{secrets.token_hex(4)}"


def new_secret() -> str:
    try:
        from ddl.identity import new_secret as ddl_new_secret
    except ImportError:  # ddl's rule, for a launcher host without a working ddl
        return secrets.token_urlsafe(32)
    return ddl_new_secret()


def job_secret_env(request: Request, environ: Mapping[str, str],
                   draw: Callable[[], str] = new_secret) -> dict[str, str]:
    """The variables that carry the job's secret to every rank: the user's own
    (DDL_JOB_SECRET / DDL_JOB_SECRET_FILE in ddlrun's environment) passed on, none when
    ``-x`` already exports one, else a new secret."""
    if any(key in envs.SECRET_SOURCES for key, _ in request.env):
        return {}
    theirs = {key: environ[key] for key in envs.SECRET_SOURCES if environ.get(key)}
    return theirs or {envs.DDL_JOB_SECRET: draw()}


def _user_env_value(cfg: Config, name: str, environ: Mapping[str, str]) -> str | None:
    """What ``name`` will be for the ranks: from ``-x``, else (ranks on this host inherit
    ddlrun's environment) from ours."""
    for key, value in cfg.request.env:
        if key == name:
            return environ.get(key) if value is None else value
    return environ.get(name) if cfg.launcher == "local" else None


def job_ports(cfg: Config, master_port: int | None, environ: Mapping[str, str]) -> dict[int, str]:
    """The ports rank 0's host will bind, and what each is for (for preflight messages)."""
    ports: dict[int, str] = {}
    ddl_port = _user_env_value(cfg, envs.DDL_PORT, environ)
    store = int(ddl_port) if ddl_port and ddl_port.isdigit() else None
    if master_port:
        ports[master_port] = (f"MASTER_PORT {master_port} (torch's init_process_group binds "
                              "it)")
        from ddl.config import store_port  # the core binds it: its rule

        store = store_port(master_port, store)
    if store:
        ports.setdefault(store, f"ddl's store port {store} (DDL_PORT, default MASTER_PORT+1)")
    return ports


def run_cleanup(job_id: str | None, sink: OutputSink) -> int:
    """``ddlrun --cleanup``: this host only (run it on each host of a killed job)."""
    if job_id:
        for name in cleanup(validate_job_id(job_id), None):
            print(f"removed /dev/shm/{name}", flush=True)
        return 0
    removed = sweep_orphans()
    for name, size in removed:
        print(f"removed /dev/shm/{name} ({mib(size)})", flush=True)
    if removed:
        sink.note(f"removed {len(removed)} orphaned shared-memory segment(s) "
                  f"({mib(sum(size for _, size in removed))})")
    else:
        sink.note("no orphaned shared-memory segments of this user on this host")
    return 0


def sweep_at_start(sink: OutputSink) -> None:
    """Every start removes what killed jobs left here; quiet unless it removed something."""
    swept = sweep_orphans()
    if swept:
        sink.note(f"removed {len(swept)} orphaned shared-memory segment(s) of killed jobs "
                  f"({mib(sum(size for _, size in swept))}; see ddlrun --cleanup)")


# ---------------------------------------------------------------------------- preflight
def gather_facts(cfg: Config, backend, ports: Sequence[int] = ()
                 ) -> tuple[dict[str, HostFacts], list[ProbeResult]]:
    """Probe every host: in-process for local ones, through the backend's transport (ssh,
    blaunch) for remote ones; host 0 checks ``ports``. Returns facts and the raw results."""
    req = cfg.request
    iface = req.network_interface
    here = {socket.gethostname()}

    # Remote hosts are probed over the backend's own transport (ssh for mpirun).
    remote = backend if isinstance(backend, AgentBackend) else SshBackend(cfg.options)

    program = req.program
    python = program[0] if program and is_python(program[0]) else None

    def one(host: HostSpec, check: Sequence[int]) -> ProbeResult:
        if is_local(host.name, here):
            return ProbeResult(host.name, probe(check, iface, python), None)
        return probe_remote(host.name, remote.probe_cmd(host, check, iface, python),
                            cfg.options.start_timeout + 5, remote.fix_hint(host))

    hosts = list(req.hosts)
    results = probe_all([h.name for h in hosts],
                        lambda name: one(next(h for h in hosts if h.name == name),
                                         ports if name == hosts[0].name else ()))
    facts = {r.host: facts_from_probe(r.data) for r in results if r.data is not None}
    return facts, results


def preflight(cfg: Config, backend: Backend, sink: OutputSink,
              environ: Mapping[str, str]) -> dict[str, HostFacts]:
    """Probe the hosts (--check, or before a real run unless --no-preflight; never under
    srun, which places ranks itself) and raise PreflightError on any problem; for
    --dry-run, learn only what this host can say about itself (no ssh)."""
    probes = cfg.launcher != "slurm"
    if cfg.check or (cfg.preflight and not cfg.dry_run and probes):
        binds = not cfg.per_node or cfg.request.node_rank == 0  # host 0 binds the ports
        ports = job_ports(cfg, cfg.master_port, environ) if binds else {}
        facts, results = gather_facts(cfg, backend, list(ports))
        table = version_table(results)
        problems = check(results, cfg.request.network_interface, ports)
        if cfg.check or cfg.verbose:
            print(table, flush=True)
        if problems:
            raise PreflightError(problems, table)
        if cfg.check:
            sink.note(f"preflight ok: {len(results)} host(s)")
        return facts
    if cfg.dry_run:
        here = {socket.gethostname()}
        return {h.name: facts_from_probe(probe((), None)) for h in cfg.request.hosts
                if is_local(h.name, here)}
    return {}


# ---------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class JobInputs:
    """What planning needs that is drawn, not derived (a clock, randomness, a port bound to
    test it): drawn once, before the pure ``make_plan``. ``notes``: what the user should
    know about how they were chosen."""

    job_id: str
    master_port: int
    secret_env: Mapping[str, str]
    notes: tuple[str, ...] = ()


FALLBACK_PORT = 29500  # torchrun's default: host 0 was not probed for a free one


def choose_port(cfg: Config, facts: Mapping[str, HostFacts],
                pick: Callable[[], int] = pick_free_pair) -> tuple[int, str | None]:
    """MASTER_PORT: --master-port, else the free pair preflight found on host 0, else one
    picked free here when host 0 is this host, else 29500, unchecked (with a note)."""
    host0 = cfg.request.hosts[0].name
    if cfg.master_port:
        return cfg.master_port, None
    probed = facts.get(host0)
    if probed and probed.free_port:
        return probed.free_port, None
    if is_local(host0, {socket.gethostname()}):
        return pick(), None
    why = "--dry-run" if cfg.dry_run else "--no-preflight" if not cfg.preflight else "srun"
    return FALLBACK_PORT, (f"note: MASTER_PORT {FALLBACK_PORT} (and {FALLBACK_PORT + 1} for "
                           f"ddl's store) on {host0}, not checked free: {host0} was not probed "
                           f"({why}); give --master-port to choose")


def secret_for(cfg: Config, environ: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """The variables carrying the job's secret, and a warning when the job has none."""
    if not cfg.per_node:
        return job_secret_env(cfg.request, environ), None
    # every node's ddlrun must hand the same secret: only the user's can be that
    theirs = {k: environ[k] for k in envs.SECRET_SOURCES if environ.get(k)}
    if theirs or any(k in envs.SECRET_SOURCES for k, _ in cfg.request.env):
        return theirs, None
    return {}, ("warning: no DDL_JOB_SECRET or DDL_JOB_SECRET_FILE in this environment: the "
                "job's rendezvous is open to anyone who can reach MASTER_ADDR:MASTER_PORT (set "
                "one, the same on every node)")


def job_inputs(cfg: Config, facts: Mapping[str, HostFacts],
               environ: Mapping[str, str]) -> JobInputs:
    """Draw the job id, the port and the secret (the side effects of planning)."""
    port, port_note = choose_port(cfg, facts)
    secret_env, secret_note = secret_for(cfg, environ)
    notes = tuple(n for n in (port_note, secret_note) if n)
    return JobInputs(cfg.job_id or new_job_id(), port, secret_env, notes)


def plan_job(cfg: Config, facts: Mapping[str, HostFacts], inputs: JobInputs,
             environ: Mapping[str, str]) -> JobPlan:
    """Pure: the job plan from the config, what preflight learned and the drawn inputs."""
    return make_plan(cfg.request, facts, inputs.job_id, inputs.master_port, environ,
                     inputs.secret_env,
                     export_job_id=not cfg.per_node or cfg.job_id is not None)


# ---------------------------------------------------------------------------- act
def print_dry_run(cfg: Config, plan: JobPlan, backend: Backend) -> None:
    """--dry-run: every rank's argv, cwd and env, what else the run uses (mpirun's
    rankfile, path and content) and the commands."""
    print(describe(plan, cfg.options.cwd))
    for line in backend.plan_notes(plan):
        print(line)
    for argv_ in backend.commands(plan):
        print("command: " + shlex.join(argv_))
    sys.stdout.flush()


def act(cfg: Config, plan: JobPlan, backend: Backend, sink: OutputSink) -> int:
    """Print the plan (--dry-run) or run it to its end and return its exit code."""
    if cfg.dry_run:
        print_dry_run(cfg, plan, backend)
        return 0
    sweep_at_start(sink)
    if cfg.verbose:
        sink.note(describe(plan, cfg.options.cwd))
    if (cfg.launcher != "local" or cfg.verbose) and not backend.notes_own_command:
        for argv_ in backend.commands(plan):
            sink.note("running: " + shlex.join(argv_))
    sink.open_logs(log_paths(cfg.log_dir, plan.job_id, (r.rank for r in plan.ranks)))
    try:
        with signals_raise():
            outcome = supervise(plan, backend, sink, cfg.timeout, cfg.options.grace)
    finally:
        sink.close()
    return outcome.code
