"""The steps of a run around the command line: ``read_files()`` (what the files it names
hold, for the pure ``configure.config_from_args``), ``preflight()`` (probe the hosts),
``check_program()`` (a missing script or module fails before any rank starts),
``job_inputs()`` (draw the job id, the port and the secret: the side effects planning
needs), ``plan_job()`` (pure: ``plan.make_plan``), ``act()`` (print the plan for --dry-run,
or run it under ``run.supervise``), and the modes that run no job (--cleanup).
Side effects live here and in the backends, never in the planner.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import core, envs
from .backends import Backend
from .backends.ssh import AgentBackend, SshBackend
from .config import Config, Files
from .errors import PreflightError, UsageError
from .events import RankExit, describe_code
from .hosts import HostSpec, is_local, read_text_lines
from .output import OutputSink, log_paths
from .plan import Attempt, HostFacts, JobPlan, Request, attempt_job_id, make_plan
from .plan_render import describe
from .preflight import (
    ProbeResult,
    ProbeRuns,
    check,
    facts_from_probe,
    pick_free_pair,
    probe,
    probe_all,
    probe_remote,
    version_table,
)
from .run import (
    Interrupted,
    Outcome,
    report_end,
    signals_deferred,
    signals_raise,
    supervise,
)
from .shm import Janitor, cleanup, job_secret, mib, sweep_orphans

PYTHON_NAME = re.compile(r"python[0-9.]*")


def is_python(program: str) -> bool:
    """Whether the program is a python interpreter (``python``, ``python3.11``, a path)."""
    return bool(PYTHON_NAME.fullmatch(os.path.basename(program)))


def new_job_id() -> str:
    return f"{time.strftime('%Y%m%d%H%M%S')}_{secrets.token_hex(4)}"


def job_secret_env(request: Request, environ: Mapping[str, str],
                   draw: Callable[[], str] = core.new_secret) -> dict[str, str]:
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


def ddl_env(cfg: Config, environ: Mapping[str, str]) -> dict[str, str]:
    """ddl's own variables (``ddl.config``'s registry) as the ranks will get them, from
    ``-x`` or ddlrun's environment, less those ddlrun sets itself. Empty where ``import
    ddl`` fails here: the workers' ddl then reads them."""
    config = core.config()
    if config is None:  # left to the ranks
        return {}
    ours = set(envs.of_kind("rank", "torchrun", "horovodrun", "layout"))
    given = {name: _user_env_value(cfg, name, environ) for name in config.REGISTRY
             if name.startswith("DDL_") and name not in ours}
    return {name: value for name, value in given.items() if value}


def check_ddl_env(cfg: Config, environ: Mapping[str, str]) -> None:
    """ddl's variables by ddl's own rules (``ddl.config.get``: the type and the allowed
    range), and the store port they leave: a bad value is one UsageError line here,
    before any host is probed, instead of a traceback from every rank's ``ddl.init()``."""
    given = ddl_env(cfg, environ)
    config, errors = core.config(), core.errors()
    if (not given and not cfg.master_port) or config is None or errors is None:
        return  # nothing to check, or left to the ranks (no ddl here)
    exported = {key for key, _ in cfg.request.env}
    for name in given:
        try:
            config.get(name, given)
        except errors.DDLConfigError as exc:
            where = "-x" if name in exported else "ddlrun's environment"
            raise UsageError(f"{exc}; the ranks would get it from {where}") from None
    if cfg.master_port:
        try:
            config.store_port(cfg.master_port, config.get(envs.DDL_PORT, given))
        except errors.DDLConfigError as exc:
            raise UsageError(f"--master-port {cfg.master_port}: {exc}") from None


def check_staging(cfg: Config, plan: JobPlan, environ: Mapping[str, str]) -> None:
    """A job on one host that sets the shared-memory engine's staging: its size for the
    host's ranks by the engine's own rule (``ddl.engines.shm.staging_slot``), so a
    DDL_SHM_MAX_BYTES too small for them is one UsageError line here. Across hosts the
    engines' sizes follow the mode's grid: the ranks check them."""
    given = ddl_env(cfg, environ)
    slot, area = "DDL_SHM_SLOT_BYTES", "DDL_SHM_MAX_BYTES"
    if len(plan.hosts) != 1 or cfg.per_node or not given.keys() & {slot, area}:
        return
    # ``given`` is not empty: ddl imported (``ddl_env``)
    config = core.require(core.config(), "the staging size")
    shm_engine = core.require(core.shm_engine(), "the staging size")
    errors = core.require(core.errors(), "the staging size")
    try:
        shm_engine.staging_slot(config.get(slot, given), config.get(area, given),
                                len(plan.hosts[0].ranks))
    except errors.DDLConfigError as exc:
        raise UsageError(str(exc)) from None


def job_ports(cfg: Config, master_port: int | None, environ: Mapping[str, str]) -> dict[int, str]:
    """The ports rank 0's host will bind, and what each is for (for preflight messages).
    The values were checked (``check_ddl_env``)."""
    ports: dict[int, str] = {}
    given = ddl_env(cfg, environ)  # not empty: ddl imported
    config = core.config()
    store = None
    if given.get(envs.DDL_PORT):
        store = config.get(envs.DDL_PORT, given)
    if master_port:
        ports[master_port] = (f"MASTER_PORT {master_port} (torch's init_process_group binds "
                              "it)")
        if config is not None:  # the core binds it: its rule; without ddl, the ranks'
            store = config.store_port(master_port, store)
    if store:
        ports.setdefault(store, f"ddl's store port {store} (DDL_PORT, default MASTER_PORT+1)")
    return ports


def run_cleanup(job_id: str | None, sink: OutputSink) -> int:
    """``ddlrun --cleanup``: this host only (run it on each host of a killed job)."""
    if job_id:  # the job's secret, if it had one, from DDL_JOB_SECRET(_FILE) here
        for name in cleanup(core.validate_job_id(job_id), None, job_secret(os.environ), sink.note):
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


# ---------------------------------------------------------------------------- files
def runs_itself(path: str) -> bool:
    """Whether a ``.py`` program runs without an interpreter: executable, with a ``#!``."""
    try:
        with open(path, "rb") as f:
            shebang = f.read(2) == b"#!"
    except OSError:
        return False
    return shebang and os.access(path, os.X_OK)


def read_files(named: Sequence[tuple[str, str]], script: str | None = None) -> Files:
    """Read what ``configure.config_from_args`` needs of the files the command line names:
    ``named`` as (path, what) pairs, each one's lines (a UsageError naming ``what path``
    when it cannot be read or is not UTF-8), and whether ``script`` runs itself."""
    texts = {path: tuple(read_text_lines(path, what)) for path, what in named}
    return Files(texts, frozenset({script} if script and runs_itself(script) else ()))


# python's options that take the next word as their value (``python -W error x.py``)
_PYTHON_VALUED = frozenset({"-W", "-X", "--check-hash-based-pycs"})


def python_target(argv: Sequence[str]) -> tuple[str, str] | None:
    """What a ``python ...`` argv runs: ("file", path), ("module", name), or None for
    ``-c``, stdin or nothing at all."""
    words = iter(argv[1:])
    for word in words:
        if word == "--":
            path = next(words, None)
            return ("file", path) if path else None
        if word == "-":
            return None
        if not word.startswith("-"):
            return "file", word
        if word.startswith("--"):  # --check-hash-based-pycs VALUE, --help...
            if word in _PYTHON_VALUED:
                next(words, None)
            continue
        # short options, combined as python takes them: -u, -uc CODE, -um pkg, -Wignore
        for i, letter in enumerate(word[1:], 1):
            rest = word[i + 1:]
            if letter == "c":
                return None
            if letter == "m":
                name = rest or next(words, None)
                return ("module", name) if name else None
            if f"-{letter}" in _PYTHON_VALUED:
                if not rest:
                    next(words, None)
                break
    return None


def check_program(cfg: Config, environ: Mapping[str, str]) -> None:
    """Before any rank starts: a python program's file, or its ``-m`` module, exists,
    told in one line as python's own "can't open file" (UsageError). Only a job on this
    host is checked (another host's files cannot be seen from here), the module only when
    the ranks' python is this one and ``-x`` gives them no PATH or PYTHONPATH of their own."""
    program = cfg.request.program
    if cfg.launcher != "local" or not program or not is_python(program[0]):
        return
    target = python_target(program)
    cwd = cfg.options.cwd or os.getcwd()
    if target is None:
        return
    kind, name = target
    if kind == "file":
        path = os.path.join(cwd, name)
        if not os.path.exists(path):
            raise UsageError(f"{program[0]}: can't open file {path!r}: [Errno 2] No such "
                             "file or directory; no rank was started")
        return
    python = shutil.which(program[0], path=environ.get("PATH"))
    if (python is None or os.path.abspath(python) != os.path.abspath(sys.executable)
            or any(key in ("PATH", "PYTHONPATH") for key, _ in cfg.request.env)):
        return
    top = name.split(".")[0]
    search = [cwd, *environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path[1:]]
    if (top in sys.builtin_module_names or importlib.util.find_spec(top) is not None
            or importlib.machinery.PathFinder.find_spec(top, [p for p in search if p])
            is not None):
        return
    raise UsageError(f"{program[0]}: No module named {top}; no rank was started")


# ---------------------------------------------------------------------------- preflight
def gather_facts(cfg: Config, backend, ports: Sequence[int] = ()
                 ) -> tuple[dict[str, HostFacts], list[ProbeResult]]:
    """Probe every host: in-process for local ones, through the backend's transport (ssh,
    blaunch) for remote ones; host 0 checks ``ports``. Returns facts and the raw results.
    Interrupted (``signals_raise``), it kills the probes still running and re-raises."""
    req = cfg.request
    runs = ProbeRuns()
    iface = req.network_interface
    here = {socket.gethostname()}

    # Remote hosts are probed over the backend's own transport (ssh for mpirun).
    remote = backend if isinstance(backend, AgentBackend) else SshBackend(cfg.options)

    program = req.program
    python = program[0] if program and is_python(program[0]) else None

    def one(host: HostSpec, check: Sequence[int]) -> ProbeResult:
        if is_local(host.name, here):
            return ProbeResult(host.name, probe(check, iface, python, runs.run), None)
        return probe_remote(host.name, remote.probe_cmd(host, check, iface, python),
                            cfg.options.start_timeout + 5, remote.fix_hint(host), runs.run)

    hosts = list(req.hosts)
    results = probe_all([h.name for h in hosts],
                        lambda name: one(next(h for h in hosts if h.name == name),
                                         ports if name == hosts[0].name else ()),
                        stop=runs.kill)
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
    attempt: int = 0  # which start of the job (--max-restarts): 0 first
    run_id: str | None = None  # the first attempt's job id, shared by every attempt


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


def secret_for(cfg: Config, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables carrying the job's secret. With one ddlrun per node, every node's
    ddlrun must hand the same secret, so only the user's can be that; without one the job
    runs open, and rank 0's ddl says so in one line for the whole job (a warning from each
    node's ddlrun too would repeat it)."""
    if not cfg.per_node:
        return job_secret_env(cfg.request, environ)
    return {k: environ[k] for k in envs.SECRET_SOURCES if environ.get(k)}


def job_inputs(cfg: Config, facts: Mapping[str, HostFacts],
               environ: Mapping[str, str]) -> JobInputs:
    """Draw the job id, the port and the secret (the side effects of planning)."""
    port, port_note = choose_port(cfg, facts)
    notes = (port_note,) if port_note else ()
    return JobInputs(cfg.job_id or new_job_id(), port, secret_for(cfg, environ), notes)


def restart_inputs(cfg: Config, first: JobInputs, attempt: int,
                   environ: Mapping[str, str],
                   pick: Callable[[], int] = pick_free_pair) -> JobInputs:
    """The inputs of restart ``attempt`` (1, 2, ...) of the job ``first`` drew: a job id of
    its own (``attempt_job_id``: new shared memory), a port picked free again unless
    --master-port gave one, and a new secret unless it is the user's (a new rendezvous).
    Restarts run on this host only (``configure.parse_max_restarts``), so the port is picked
    here."""
    run_id = first.run_id or first.job_id
    port = cfg.master_port or pick()
    return JobInputs(attempt_job_id(run_id, attempt), port, secret_for(cfg, environ), (),
                     attempt, run_id)


def plan_job(cfg: Config, facts: Mapping[str, HostFacts], inputs: JobInputs,
             environ: Mapping[str, str]) -> JobPlan:
    """Pure: the job plan from the config, what preflight learned and the drawn inputs."""
    return make_plan(cfg.request, facts, inputs.job_id, inputs.master_port, environ,
                     inputs.secret_env,
                     export_job_id=not cfg.per_node or cfg.job_id is not None,
                     attempt=Attempt(inputs.attempt, cfg.max_restarts, inputs.run_id))


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


# the plan and backend of restart N (1, 2, ...): ``cli`` draws its inputs and plans it
NextAttempt = Callable[[int], tuple[JobPlan, Backend]]


def act(cfg: Config, plan: JobPlan, backend: Backend, sink: OutputSink,
        next_attempt: NextAttempt | None = None) -> int:
    """Print the plan (--dry-run) or run it to its end and return its exit code. With
    --max-restarts N (and ``next_attempt``), a rank's failure stops every rank, as always,
    and then the whole job starts again, up to N times, torchrun's way (its agent's
    ``_invoke_run``): each attempt a new job (``restart_inputs``), the --timeout counted
    over all of them. A signal to ddlrun ends the job, whenever it comes."""
    if cfg.dry_run:
        print_dry_run(cfg, plan, backend)
        return 0
    sweep_at_start(sink)
    deadline = time.monotonic() + cfg.timeout if cfg.timeout else None
    try:
        with signals_raise():
            for attempt in range(cfg.max_restarts + 1):
                outcome = run_attempt(cfg, plan, backend, sink, deadline)
                failure = _restart_due(cfg, outcome, attempt, deadline, sink)
                if failure is None or next_attempt is None:
                    report_end(plan, sink, outcome)
                    if cfg.max_restarts and outcome.late_signal is not None:
                        return 128 + outcome.late_signal  # the user's stop ended the run
                    return outcome.code
                plan, backend = next_attempt(attempt + 1)
                sink.note(f"{_failure_line(failure, backend)}; restart {attempt + 1} of "
                          f"{cfg.max_restarts} (job {plan.job_id})")
            raise AssertionError("unreachable: the last attempt has no restart")
    except Interrupted as exc:  # between attempts: nothing of the last one is running
        sink.note(f"{exc}: stopped; no rank is running")
        return 128 + exc.signum
    finally:
        sink.close()


def _restart_due(cfg: Config, outcome: Outcome, attempt: int, deadline: float | None,
                 sink: OutputSink) -> RankExit | None:
    """The failure the job starts again for: a rank's (not a timeout, a signal or a
    program that cannot start), with restarts and time left; None when it ends. Says why
    not when restarts were asked for."""
    failure = outcome.failure
    if not isinstance(failure, RankExit) or not outcome.code or not cfg.max_restarts:
        return None
    if outcome.late_signal is not None:
        sink.note(f"{signal.Signals(outcome.late_signal).name} during the teardown: no restart")
        return None
    if attempt >= cfg.max_restarts:
        sink.note(f"{_failure_line(failure, None)}; no restart left (--max-restarts "
                  f"{cfg.max_restarts} used)")
        return None
    if deadline is not None and time.monotonic() >= deadline:
        sink.note(f"--timeout {cfg.timeout:g}s used up: no restart")
        return None
    return failure


def _failure_line(ev: RankExit, backend: Backend | None) -> str:
    """``rank R failed (why)`` for the restart's line."""
    how = describe_code(ev.code)
    if ev.record is not None:
        cwd = backend.opts.cwd if backend is not None and backend.opts.cwd else os.getcwd()
        how = f"{ev.record.summary(cwd)}, {how}"
    return f"rank {ev.rank} failed ({how})"


def run_attempt(cfg: Config, plan: JobPlan, backend: Backend, sink: OutputSink,
                deadline: float | None, events: queue.Queue | None = None) -> Outcome:
    """One start of the job: logs, janitor, ``supervise``, this host's shared memory after;
    ``deadline`` (``time.monotonic``) the end of --timeout, for every start together;
    ``events``: the supervisor's channel, for a caller that adds its own (``Superseded``). The
    teardown is not cut short by a signal: one that comes then is raised after it."""
    if cfg.verbose:
        sink.note(describe(plan, cfg.options.cwd))
    if (cfg.launcher != "local" or cfg.verbose) and not backend.notes_own_command:
        for argv_ in backend.commands(plan):
            sink.note("running: " + shlex.join(argv_))
    sink.restart_logs(log_paths(cfg.log_dir, plan.job_id, (r.rank for r in plan.ranks)))
    # This host's /dev/shm after the job, or at once if ddlrun is killed (the janitor): the
    # job's segments of every host index its ranks use, as only those here can be reached
    # (the ssh/blaunch agents do the same on theirs).
    indexes = shm_host_indexes(plan)
    secret = job_secret(plan.ranks[0].env_dict()) if plan.ranks else None
    janitor = Janitor.start(plan.job_id, indexes, secret)
    try:
        outcome = supervise(plan, backend, sink, cfg.timeout, cfg.options.grace,
                            end_note=False, deadline=deadline, events=events)
    finally:
        with signals_deferred() as late:
            try:
                for index in indexes:  # what a crashed rank left
                    cleanup(plan.job_id, index, secret, sink.note)
            finally:
                if janitor is not None:
                    janitor.finish()
    if late:
        raise Interrupted(late[0])
    return outcome


def shm_host_indexes(plan: JobPlan) -> list[int]:
    """The host indexes the ranks name their segments with: ``DDL_HOST_INDEX``, which is
    the node's rank when one ddlrun runs per node (its plan's only host is index 0)."""
    return sorted({int(r.env_dict().get(envs.DDL_HOST_INDEX, r.host_index))
                   for r in plan.ranks})
