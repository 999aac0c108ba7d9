"""ddlrun command line: ``build_parser()`` -> ``config_from_args()`` (typed, validated, no
side effects) -> ``main()`` (preflight, plan, act).

Host precedence: ``-H`` or ``--hostfile`` (not both), else the Slurm/LSF allocation ddlrun
runs in, else this host (``-n N`` local ranks). ``--launcher auto`` picks slurm/lsf inside an
allocation, ssh when any host is not this one, local otherwise.

Side effects live here, not in the planner: the job id, the free port, the job's secret
(``job_secret_env``) and the sweep of orphaned shared memory at start.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import version
from .backends import LaunchOptions, get_backend, is_root
from .backends.mpirun import parse_mpiargs
from .backends.ssh import AgentBackend, SshBackend
from .errors import LaunchError, PreflightError, UsageError
from .hosts import (
    HostSpec,
    detect_allocation,
    is_local,
    lsf_hosts,
    parse_host_list,
    parse_hostfile,
    slurm_hosts,
)
from .output import OutputSink, log_paths
from .plan import (
    SECRET_SOURCES,
    HostFacts,
    Request,
    describe,
    make_plan,
    parse_rankfile,
    validate_env_name,
    validate_job_id,
)
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

LAUNCHERS = ("auto", "local", "ssh", "mpirun", "slurm", "lsf")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddlrun",
        description="Launch a distributed job on this host or many (local, ssh, mpirun, "
        "Slurm, LSF). Every rank gets the torchrun env contract plus DDL_OPTIONS.",
        epilog="example: ddlrun -H h1:4,h2:4 python train.py --epochs 3",
    )
    a = p.add_argument
    g = p.add_argument_group("where to run")
    g.add_argument("-n", dest="nproc", type=int, help="total ranks (default: all slots)")
    g.add_argument("-H", dest="hosts", metavar="HOST[:N],...", help="hosts and slots")
    g.add_argument("--hostfile", help="file of 'host slots=N' or 'host:N' lines")
    g.add_argument("--accelerators", type=int, metavar="N",
                   help="ranks per host (default: slots, else GPUs detected, else 1 or -n)")
    g.add_argument("--rankfile", help="Open MPI rankfile ('rank N=host slot=S') placing ranks")
    g.add_argument("--launcher", choices=LAUNCHERS, default="auto")
    d = p.add_argument_group("DDL topology")
    d.add_argument("-m", "--mode", help="DDL mode letters (r,n,b,p) or a full spec 'b:4x2'")
    d.add_argument("--racks", type=int, help="number of racks (hosts split evenly)")
    d.add_argument("--aisles", type=int, help="number of aisles (racks split evenly)")
    d.add_argument("--ddloption", action="append", default=[], metavar="OPT",
                   help="extra DDL option, e.g. '-dump_iter 100' (repeatable)")
    d.add_argument("--no_ddloptions", action="store_true", help="do not set DDL_OPTIONS")
    e = p.add_argument_group("rank environment")
    e.add_argument("-x", "--env", action="append", default=[], metavar="KEY[=VAL]",
                   help="export to ranks (KEY alone: this shell's value)")
    e.add_argument("--network-interface", metavar="IFACE",
                   help="interface ranks use: sets GLOO/NCCL_SOCKET_IFNAME and MASTER_ADDR")
    e.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    e.add_argument("--master-addr", help="rendezvous address (default: host 0's)")
    e.add_argument("--job-id", help="job id (default: time + random)")
    e.add_argument("--tcp", action="store_true",
                   help="TCP only: NCCL_IB_DISABLE=1, mpirun btl tcp")
    c = p.add_argument_group("ssh / mpirun")
    c.add_argument("--ssh-port", type=int)
    c.add_argument("--ssh-identity", metavar="KEYFILE")
    c.add_argument("--ssh-config", metavar="FILE", help="ssh -F config file")
    c.add_argument("--remote-python", default=sys.executable,
                   help="python with powerddl on the remote hosts (default: this one's path)")
    c.add_argument("--mpiarg", action="append", default=[], help="extra mpirun/srun arguments")
    r = p.add_argument_group("run")
    r.add_argument("--dry-run", action="store_true",
                   help="print per-host commands and per-rank env; start nothing")
    r.add_argument("--check", action="store_true", help="preflight only")
    r.add_argument("--cleanup", action="store_true",
                   help="remove shared memory of killed jobs on this host (with --job-id: "
                   "all of that job's) and exit")
    r.add_argument("--no-preflight", action="store_true", help="skip the preflight at start")
    r.add_argument("--log-dir", help="write per-rank stdout/stderr under DIR/<job id>/")
    r.add_argument("--tag-output", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix lines with [rank] (default: on)")
    r.add_argument("--timeout", type=float, help="seconds for the whole job")
    r.add_argument("--start-timeout", type=float, default=30.0,
                   help="seconds for ssh/preflight per host (default 30)")
    r.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL at teardown (default 5)")
    a("-v", "--verbose", action="store_true", help="print the plan and commands")
    a("--version", action="version", version=f"ddlrun (powerddl) {version()}")
    a("program", nargs=argparse.REMAINDER, help="program and its arguments")
    return p


@dataclass(frozen=True)
class Config:
    request: Request
    options: LaunchOptions
    launcher: str
    dry_run: bool = False
    check: bool = False
    cleanup: bool = False
    preflight: bool = True
    log_dir: str | None = None
    timeout: float | None = None
    master_port: int | None = None
    job_id: str | None = None
    verbose: bool = False


def _read(path: str, what: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror}") from None


def _positive(value, name: str) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{name} must be at least 1, got {value}")


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Config:
    program = list(args.program)
    if program and program[0] == "--":
        program = program[1:]
    for value, name in ((args.nproc, "-n"), (args.accelerators, "--accelerators"),
                        (args.racks, "--racks"), (args.aisles, "--aisles")):
        _positive(value, name)
    if args.hosts and args.hostfile:
        raise UsageError("give -H or --hostfile, not both")
    allocation = None
    if args.hosts:
        hosts = parse_host_list(args.hosts)
    elif args.hostfile:
        hosts = parse_hostfile(_read(args.hostfile, "--hostfile"), args.hostfile)
    else:
        allocation = detect_allocation(environ) if args.launcher in ("auto", "slurm", "lsf") \
            else None
        if allocation == "slurm":
            hosts = slurm_hosts(environ)
        elif allocation == "lsf":
            hosts = lsf_hosts(environ)
        else:
            hosts = (HostSpec("localhost", args.nproc),)
    rankfile: tuple = ()
    if args.rankfile:
        rankfile = parse_rankfile(_read(args.rankfile, "--rankfile"), args.rankfile)
    env = []
    for item in args.env:
        key, eq, val = item.partition("=")
        env.append((validate_env_name(key), val if eq else None))
    launcher = args.launcher
    if launcher == "auto":
        here = {socket.gethostname(), socket.getfqdn()}
        if allocation:
            launcher = allocation
        elif all(is_local(h.name, here) for h in hosts):
            launcher = "local"
        else:
            launcher = "ssh"
    if launcher == "local" and not all(is_local(h.name, {socket.gethostname()}) for h in hosts):
        raise UsageError("--launcher local runs on this host only; remove remote hosts or use "
                         "--launcher ssh")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise UsageError(f"--ssh-port {args.ssh_port} is out of range 1-65535")
    if args.network_interface and not args.network_interface.replace("_", "").replace(
        "-", ""
    ).replace(".", "").isalnum():
        raise UsageError(f"--network-interface {args.network_interface!r} is not an interface "
                         "name")
    for t, name in ((args.timeout, "--timeout"), (args.start_timeout, "--start-timeout")):
        if t is not None and t <= 0:
            raise UsageError(f"{name} must be positive, got {t:g}")
    request = Request(
        program=tuple(program),
        hosts=hosts,
        nproc=args.nproc,
        accelerators=args.accelerators,
        mode=args.mode,
        racks=args.racks,
        aisles=args.aisles,
        ddloptions=tuple(args.ddloption),
        no_ddloptions=args.no_ddloptions,
        env=tuple(env),
        network_interface=args.network_interface,
        master_addr=args.master_addr,
        tcp=args.tcp,
        rankfile=rankfile,
    )
    options = LaunchOptions(
        ssh_port=args.ssh_port,
        ssh_identity=args.ssh_identity,
        ssh_config=args.ssh_config,
        remote_python=args.remote_python,
        start_timeout=args.start_timeout,
        grace=args.grace,
        mpiargs=parse_mpiargs(args.mpiarg),
        tcp=args.tcp,
        network_interface=args.network_interface,
        tag_output=args.tag_output,
        is_root=is_root(),
        rankfile_path=os.path.abspath(args.rankfile) if args.rankfile else None,
        cwd=os.getcwd(),
    )
    return Config(
        request=request,
        options=options,
        launcher=launcher,
        dry_run=args.dry_run,
        check=args.check,
        cleanup=args.cleanup,
        preflight=not args.no_preflight,
        log_dir=args.log_dir,
        timeout=args.timeout,
        master_port=args.master_port,
        job_id=args.job_id,
        verbose=args.verbose,
    )


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
    if any(key in SECRET_SOURCES for key, _ in request.env):
        return {}
    theirs = {key: environ[key] for key in SECRET_SOURCES if environ.get(key)}
    return theirs or {"DDL_JOB_SECRET": draw()}


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
    ddl_port = _user_env_value(cfg, "DDL_PORT", environ)
    store = int(ddl_port) if ddl_port and ddl_port.isdigit() else None
    if master_port:
        ports[master_port] = (f"MASTER_PORT {master_port} (torch's init_process_group binds "
                              "it)")
        store = store or master_port + 1
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

    def one(host: HostSpec, check: Sequence[int]) -> ProbeResult:
        if is_local(host.name, here):
            return ProbeResult(host.name, probe(check, iface), None)
        return probe_remote(host.name, remote.probe_cmd(host, check, iface),
                            cfg.options.start_timeout + 5, remote.fix_hint(host))

    hosts = list(req.hosts)
    results = probe_all([h.name for h in hosts],
                        lambda name: one(next(h for h in hosts if h.name == name),
                                         ports if name == hosts[0].name else ()))
    facts = {r.host: facts_from_probe(r.data) for r in results if r.data is not None}
    return facts, results


# ---------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sink = OutputSink(tag=args.tag_output)
    try:
        cfg = config_from_args(args, os.environ)
        if cfg.cleanup:
            return run_cleanup(cfg.job_id, sink)
        if not cfg.request.program and not cfg.check:
            parser.print_usage(sys.stderr)
            raise UsageError("no program given: ddlrun [options] program [args...]")
        backend = get_backend(cfg.launcher, cfg.options)
        facts: dict[str, HostFacts] = {}
        can_probe = cfg.launcher != "slurm"  # srun places ranks itself
        ports = job_ports(cfg, cfg.master_port, os.environ)
        if cfg.check or (cfg.preflight and not cfg.dry_run and can_probe):
            facts, results = gather_facts(cfg, backend, list(ports))
            table = version_table(results)
            problems = check(results, cfg.request.network_interface, ports)
            if cfg.check or cfg.verbose:
                print(table, flush=True)
            if problems:
                raise PreflightError(problems, table)
            if cfg.check:
                sink.note(f"preflight ok: {len(results)} host(s)")
                return 0
        elif cfg.dry_run:
            here = {socket.gethostname()}
            facts = {h.name: facts_from_probe(probe((), None)) for h in cfg.request.hosts
                     if is_local(h.name, here)}
        job_id = cfg.job_id or new_job_id()
        host0 = cfg.request.hosts[0].name
        port = cfg.master_port or (facts.get(host0) and facts[host0].free_port)
        if not port:
            port = pick_free_pair() if is_local(host0, {socket.gethostname()}) else 29500
        plan = make_plan(cfg.request, facts, job_id, port, os.environ,
                         job_secret_env(cfg.request, os.environ))
        backend.validate(plan)
        if cfg.dry_run:
            print(describe(plan))
            for argv_ in backend.commands(plan):
                print("command: " + shlex.join(argv_))
            return 0
        sweep_at_start(sink)
        if cfg.verbose:
            sink.note(describe(plan))
        if (cfg.launcher != "local" or cfg.verbose) and not backend.notes_own_command:
            for argv_ in backend.commands(plan):
                sink.note("running: " + shlex.join(argv_))
        logs = log_paths(cfg.log_dir, job_id, (r.rank for r in plan.ranks))
        sink = OutputSink(tag=cfg.options.tag_output, logs=logs)
        try:
            with signals_raise():
                outcome = supervise(plan, backend, sink, cfg.timeout, cfg.options.grace)
        finally:
            sink.close()
        return outcome.code
    except PreflightError as exc:
        if exc.table and not (args.check or args.verbose):
            print(exc.table, file=sys.stderr)
        for problem in exc.problems:
            sink.note(f"preflight: {problem}")
        return exc.exit_code
    except LaunchError as exc:
        sink.note(f"error: {exc}")
        return exc.exit_code
