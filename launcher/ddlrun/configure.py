"""The command line's meaning: ``config_from_args(args, environ, files)`` -> a typed,
validated ``Config``, with no side effects and no file read (the hostfile, rankfile,
LSF's hostfile and the program's ``#!`` line come read by ``steps.read_files``, of the
files ``files_named`` lists), so tests call it directly.

Host precedence: ``-H`` or ``--hostfile`` (not both), else ``--nnodes N`` (> 1) or
``--node-rank K`` without hosts: one ddlrun per node, torchrun-style (this host's ranks only,
``RANK = K * nproc + local``, rendezvous at ``--master-addr``), else the Slurm/LSF allocation
ddlrun runs in, else this host (``-n N`` local ranks). ``--launcher auto`` picks slurm/lsf
inside an allocation, ssh when any host is not this one, local otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence

from . import envs
from .backends import LaunchOptions, is_root
from .backends.mpirun import parse_mpiargs
from .config import Config, Elastic, Files, NodeRendezvous
from .core import validate_job_id
from .elastic_hosts import check_cooldown_range
from .errors import UsageError
from .hosts import (
    HostSpec,
    check_slots,
    detect_allocation,
    digits,
    is_local,
    lsf_hosts,
    parse_host_list,
    parse_hostfile,
    parse_selection,
    slurm_hosts,
)
from .placement import parse_rankfile
from .plan_env import validate_env_name
from .plan_options import fixed_grid
from .plan_types import Request, attempt_job_id
from .steps import FALLBACK_PORT

MAX_RESTARTS = 1_000_000  # keeps every restart's job id (``attempt_job_id``) within 64
IFACE = re.compile(r"[A-Za-z0-9_.-]{1,15}")  # a Linux interface name (IFNAMSIZ - 1)


def _positive(value, name: str) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{name} must be at least 1, got {value}")


MODE_LETTERS = re.compile(r"[rnbp]+(?::\d+(?:x\d+)*)?")  # "b", "rb", "b:4x2": not a module


def program_argv(program: Sequence[str], python: str, module: bool = False,
                 no_python: bool = False, runs_itself: bool = False) -> list[str]:
    """The ranks' argv, torchrun's way: ``-m MODULE args`` runs ``python -m MODULE args``,
    ``--no-python`` runs the program as it is, and a ``.py`` program that does not run
    itself (``runs_itself``: an executable with a ``#!`` line, ``steps.read_files``) runs
    with ``python`` (``ddlrun -n 2 train.py``)."""
    program = list(program)
    if module and no_python:
        raise UsageError("give -m/--module or --no-python, not both")
    if module:
        if not program:
            raise UsageError("-m/--module needs a module: ddlrun [options] -m MODULE [args...]")
        if MODE_LETTERS.fullmatch(program[0]):
            # ddlrun's -m once took DDL's mode letters: say so rather than run "python -m b"
            raise UsageError(f"-m is torchrun's --module (python -m {program[0]} ...); DDL's "
                             f"mode letters are given with --mode {program[0]}")
        return [python, "-m", *program]
    if no_python or not program or not program[0].endswith(".py") or runs_itself:
        return program
    return [python, *program]


def parse_endpoint(text: str) -> tuple[str, int | None]:
    """``--rdzv-endpoint host[:port]`` (IPv6 as ``[addr]:port``)."""
    host, port = text, None
    if text.startswith("["):
        end = text.find("]")
        host, rest = text[: end + 1], text[end + 1:]
        if rest.startswith(":"):
            port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    if port is not None and not digits(port):
        raise UsageError(f"--rdzv-endpoint {text!r}: the port must be a number")
    if port is not None and not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-endpoint {text!r}: the port is out of range 1-65535")
    return host.strip("[]"), int(port) if port is not None else None


def parse_max_restarts(text: str | None, launcher: str, per_node: bool,
                       job_id: str | None) -> int:
    """``--max-restarts N``: a whole number 0 or more; above 0 only where ddlrun can
    restart the job (the local launcher, one host), and with a ``--job-id`` that leaves
    room for the restarts' ids (``attempt_job_id``)."""
    if text is None:
        return 0
    if not digits(text.strip()) or int(text) > MAX_RESTARTS:
        raise UsageError(f"--max-restarts must be a whole number from 0 to {MAX_RESTARTS}, "
                         f"got {text!r}")
    count = int(text)
    if count and launcher != "local" and not per_node:
        raise UsageError(f"--max-restarts {count}: restarts are not supported with --launcher "
                         f"{launcher} yet, only on one host or with one ddlrun per node "
                         "(torchrun's way); drop --max-restarts")
    if count and job_id is not None:
        last = attempt_job_id(validate_job_id(job_id), count)
        try:
            validate_job_id(last)
        except UsageError:
            raise UsageError(f"--job-id {job_id!r} is too long for --max-restarts {count}: "
                             f"the last restart's job id {last!r} must fit 64 characters"
                             ) from None
    return count


def parse_nnodes(text: str | int | None) -> tuple[int, int] | None:
    """``--nnodes N`` or torchrun's ``MIN:MAX``: (MIN, MAX), N being N:N; MIN above MAX
    is one line."""
    if text is None:
        return None
    if isinstance(text, int):
        return text, text
    low, sep, high = text.strip().partition(":")
    if not digits(low) or (sep and not digits(high)):
        raise UsageError(f"--nnodes {text!r}: expected a whole number N or MIN:MAX")
    if not sep:
        return int(low), int(low)
    if int(low) > int(high):
        raise UsageError(f"--nnodes {text}: MIN {int(low)} is greater than MAX {int(high)}")
    if int(low) < 1:
        raise UsageError(f"--nnodes {text}: MIN must be at least 1")
    return int(low), int(high)


RDZV_CONF = {"join_timeout": "join_timeout", "last_call_timeout": "last_call",
             "close_timeout": "close_timeout"}
RDZV_PORT = 29400  # torchrun's c10d rendezvous port when --rdzv-endpoint names none
MAX_RDZV_ID = 56  # room for '.r' and 6 digits of rounds (restarts and membership changes)


def parse_rdzv_conf(text: str | None) -> dict[str, float]:
    """torchrun's ``--rdzv-conf k=v,k=v``: the timeouts ddlrun's rendezvous has (seconds)."""
    out: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if key not in RDZV_CONF or not sep:
            raise UsageError(f"--rdzv-conf {item.strip()!r}: expected KEY=SECONDS with KEY "
                             f"one of {', '.join(RDZV_CONF)}")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds <= 86400:
            raise UsageError(f"--rdzv-conf {key}={value.strip()!r}: seconds from 0 to 86400")
        out[RDZV_CONF[key]] = seconds
    return out


def parse_node_rendezvous(args: argparse.Namespace, nodes: tuple[int, int] | None,
                          per_node: bool, max_restarts: int, master_addr: str | None,
                          master_port: int | None) -> NodeRendezvous | None:
    """torchrun's elastic shape: one ddlrun per node with ``--nnodes MIN:MAX`` (MIN <
    MAX) or ``--max-restarts`` meets the others at the endpoint each round; None for a
    fixed job."""
    ranged = nodes is not None and nodes[0] < nodes[1]
    if ranged and not per_node:
        raise UsageError(f"--nnodes {nodes[0]}:{nodes[1]} is for one ddlrun per node "
                         "(torchrun's way, without -H/--hostfile); with hosts given, use "
                         "--min-np/--max-np (Horovod's elastic training)")
    if not per_node or not (ranged or max_restarts):
        if args.rdzv_conf:
            raise UsageError("--rdzv-conf goes with --nnodes MIN:MAX or --max-restarts "
                             "and one ddlrun per node")
        return None
    if args.node_rank is not None:
        raise UsageError("--node-rank: with --nnodes MIN:MAX or --max-restarts the nodes take "
                         "their ranks in the rendezvous, as torchrun's c10d does: drop it")
    if args.nproc is not None and ranged:
        raise UsageError("-n: with --nnodes MIN:MAX the number of ranks follows the nodes "
                         "present; give --nproc-per-node instead")
    if not master_addr:
        raise UsageError("--nnodes MIN:MAX / --max-restarts with one ddlrun per node: give "
                         "--rdzv-endpoint HOST[:PORT], the same on every node (the ddlrun "
                         "on HOST serves the rendezvous)")
    if args.job_id is not None and len(args.job_id) > MAX_RDZV_ID:
        raise UsageError(f"--rdzv-id {args.job_id!r}: at most {MAX_RDZV_ID} characters with "
                         "--nnodes MIN:MAX or --max-restarts (each round's job id adds "
                         "'.r<N>', and a job id has at most 64)")
    conf = parse_rdzv_conf(args.rdzv_conf)
    assert nodes is not None
    return NodeRendezvous(nodes[0], nodes[1], master_addr, master_port or RDZV_PORT, **conf)


_ELASTIC_ONLY = (("slots", "--slots"), ("elastic_timeout", "--elastic-timeout"),
                 ("reset_limit", "--reset-limit"),
                 ("blacklist_cooldown_range", "--blacklist-cooldown-range"))


def parse_elastic(args: argparse.Namespace, launcher: str, per_node: bool, max_restarts: int,
                  nproc: int | None) -> Elastic | None:
    """Horovod's elastic flags: a job is elastic when ``--min-np``, ``--max-np`` or
    ``--host-discovery-script`` is given; the other elastic flags need one of them. In
    ddlrun starts every worker itself (the local and ssh launchers)."""
    if args.min_np is None and args.max_np is None and not args.host_discovery_script:
        for dest, flag in _ELASTIC_ONLY:
            if getattr(args, dest) is not None:
                raise UsageError(f"{flag} is for elastic jobs: give --min-np/--max-np or "
                                 "--host-discovery-script too")
        return None
    if per_node or launcher not in ("local", "ssh"):
        where = ("one ddlrun per node (--nnodes/--node-rank)" if per_node
                 else f"--launcher {launcher}")
        raise UsageError(f"elastic training (--min-np/--max-np/--host-discovery-script) is not "
                         f"supported with {where} yet: ddlrun starts the workers itself (this "
                         "host's, and other hosts' over ssh)")
    if max_restarts:
        raise UsageError("--max-restarts restarts every rank (torchrun's way); elastic flags "
                         "re-form the world in place (Horovod's): give one or the other")
    for value, flag in ((args.min_np, "--min-np"), (args.max_np, "--max-np"),
                        (args.slots, "--slots"), (nproc, "-np")):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    np_ = nproc if nproc is not None else args.min_np if args.min_np is not None else args.max_np
    min_np = args.min_np if args.min_np is not None else np_
    max_np = args.max_np if args.max_np is not None else max(np_ or 0, min_np or 0)
    if min_np is None or max_np is None:
        raise UsageError("an elastic job needs -np N (or --min-np/--max-np)")
    if args.min_np is not None and args.max_np is not None and min_np > max_np:
        raise UsageError(f"--min-np {min_np} is greater than --max-np {max_np}")
    if np_ is not None and np_ > max_np:
        raise UsageError(f"-np {np_} is greater than --max-np {max_np}")
    if np_ is not None and np_ < min_np:
        raise UsageError(f"-np {np_} is less than --min-np {min_np}")
    if args.elastic_timeout is not None and not (0 < args.elastic_timeout < math.inf):
        raise UsageError(f"--elastic-timeout must be a positive number of seconds, got "
                         f"{args.elastic_timeout:g}")
    if args.reset_limit is not None and args.reset_limit < 0:
        raise UsageError(f"--reset-limit must be 0 or more, got {args.reset_limit}")
    if not 0.1 <= args.discovery_interval <= 3600:
        raise UsageError("--discovery-interval must be between 0.1 and 3600 seconds, got "
                         f"{args.discovery_interval:g}")
    cooldown = None
    if args.blacklist_cooldown_range is not None:
        low, high = args.blacklist_cooldown_range
        check_cooldown_range((low, high))
        cooldown = (low, high)
    script = args.host_discovery_script
    return Elastic(min_np=min_np, max_np=max_np,
                   discovery_script=os.path.abspath(script) if script else None,
                   slots=args.slots,
                   timeout=args.elastic_timeout if args.elastic_timeout is not None else 600.0,
                   reset_limit=args.reset_limit, cooldown=cooldown,
                   discovery_interval=args.discovery_interval)


def _check_grid_fits(request: Request, elastic: Elastic | None,
                     rendezvous: NodeRendezvous | None,
                     env: Sequence[tuple[str, str | None]], environ: Mapping[str, str]) -> None:
    """A mode with its own dimensions fixes the number of ranks: refused, before anything
    starts, for a job whose world changes size (elastic, or --nnodes MIN:MAX), where ddlrun
    fits the grid to each world and the mode letters keep their meaning."""
    if elastic is None and (rendezvous is None
                            or rendezvous.min_nodes == rendezvous.max_nodes):
        return
    given = dict(env)  # -x DDL_OPTIONS=... (None: this shell's), as the plan reads it
    inherited = given.get(envs.DDL_OPTIONS)
    if inherited is None:
        inherited = environ.get(envs.DDL_OPTIONS)
    spec = fixed_grid(request, inherited)
    if spec is not None:
        letters = spec.partition(":")[0]
        how = "--min-np/--max-np" if elastic is not None else "--nnodes MIN:MAX"
        raise UsageError(f"-mode {spec} fixes the grid, but the world of a job with {how} "
                         f"changes size: give the mode letters only (--mode {letters}); "
                         "ddlrun fits the grid to each world")


def _same_host(a: str, b: str) -> bool:
    return a == b or (is_local(a) and is_local(b))


def select_hosts(hosts: tuple[HostSpec, ...], include, exclude) -> tuple[HostSpec, ...]:
    """Hosts left by --include / --exclude (their GPU lists are the planner's)."""
    for what, entries in (("--include", include), ("--exclude", exclude)):
        for name, _ in entries:
            if not any(_same_host(name, h.name) for h in hosts):
                raise UsageError(f"{what}: host {name!r} is not one of the job's hosts "
                                 f"({', '.join(h.name for h in hosts)})")
    if include:
        hosts = tuple(h for h in hosts if any(_same_host(n, h.name) for n, _ in include))
    if exclude:
        hosts = tuple(h for h in hosts
                      if not any(_same_host(n, h.name) and ids is None for n, ids in exclude))
    if not hosts:
        raise UsageError("--exclude leaves no hosts")
    return hosts


def _check_values(args: argparse.Namespace) -> None:
    """Each option's own value, and the options that exclude each other."""
    for value, name in ((args.nproc, "-n"), (args.accelerators, "--accelerators"),
                        (args.racks, "--racks"), (args.aisles, "--aisles"),
                        (args.nnodes, "--nnodes")):
        _positive(value, name)
    if args.accelerators is not None:
        check_slots(args.accelerators, "--accelerators")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise UsageError(f"--master-port {args.master_port} is out of range 1-65535")
    if args.hosts and args.hostfile:
        raise UsageError("give -H or --hostfile, not both")
    if args.include and args.exclude:
        raise UsageError("give --include or --exclude, not both")


def _check_run_values(args: argparse.Namespace) -> None:
    """The ssh port, the interface name and the times."""
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise UsageError(f"--ssh-port {args.ssh_port} is out of range 1-65535")
    if args.network_interface and not IFACE.fullmatch(args.network_interface):
        raise UsageError(f"--network-interface {args.network_interface!r} is not an interface "
                         "name")
    for t, name in ((args.timeout, "--timeout"), (args.start_timeout, "--start-timeout")):
        if t is not None and not (math.isfinite(t) and t > 0):  # nan would disable it
            raise UsageError(f"{name} must be a positive number of seconds, got {t:g}")
    if not (math.isfinite(args.grace) and args.grace >= 0):
        raise UsageError(f"--grace must be 0 or more seconds, got {args.grace:g}")


def _launcher_asked(args: argparse.Namespace) -> tuple[str, bool]:
    """(--launcher or its horovodrun alias, whether --gloo was given)."""
    launcher = args.launcher or "auto"
    if args.launcher_alias:
        alias = "--mpi" if args.launcher_alias == "mpirun" else "--gloo"
        if args.launcher and args.launcher != "auto":
            raise UsageError(f"give {alias} or --launcher, not both")
        launcher = "mpirun" if args.launcher_alias == "mpirun" else "auto"
    return launcher, args.launcher_alias == "gloo"


def is_per_node(args: argparse.Namespace) -> bool:
    """One ddlrun per node (torchrun-style): --nnodes N > 1 or --node-rank, without hosts."""
    given_hosts = bool(args.hosts or args.hostfile)
    per_node = not given_hosts and (args.node_rank is not None or (args.nnodes or 1) > 1)
    if args.standalone and (per_node or given_hosts):
        raise UsageError("--standalone runs one node: drop --nnodes/--node-rank/-H")
    if args.node_rank is not None and given_hosts:
        raise UsageError("--node-rank is for one ddlrun per node (without -H/--hostfile); "
                         "with -H or --hostfile one ddlrun starts every host")
    return per_node


def uses_allocation(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The Slurm/LSF allocation the job's hosts come from: none with -H/--hostfile, one
    ddlrun per node, --gloo or a launcher of ddlrun's own."""
    launcher, gloo = _launcher_asked(args)
    if args.hosts or args.hostfile or is_per_node(args) or gloo:
        return None
    return detect_allocation(environ) if launcher in ("auto", "slurm", "lsf") else None


def _per_node_layout(args: argparse.Namespace, launcher: str, master_addr: str | None
                     ) -> tuple[int | None, int]:
    """One ddlrun per node: (ranks on this node or None for the default, --nnodes)."""
    nnodes = args.nnodes
    if nnodes is None:
        raise UsageError("--node-rank needs --nnodes N (the number of nodes)")
    node_rank = args.node_rank or 0
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes)")
    if not master_addr:
        raise UsageError("--nnodes without -H runs one ddlrun per node: give "
                         "--rdzv-endpoint HOST[:PORT] or --master-addr, the same on every "
                         "node (node 0's address; with --nnodes MIN:MAX or --max-restarts "
                         "the node whose ddlrun serves the rendezvous)")
    if launcher not in ("auto", "local"):
        raise UsageError(f"--launcher {launcher}: one ddlrun per node starts its own "
                         "node's ranks (local); use -H/--hostfile for ssh or mpirun")
    accelerators, nproc = args.accelerators, args.nproc
    if nproc is not None:
        if accelerators is not None and accelerators * nnodes != nproc:
            raise UsageError(f"-n {nproc} is not --nnodes {nnodes} x --nproc-per-node "
                             f"{accelerators}")
        if nproc % nnodes:
            raise UsageError(f"-n {nproc} does not split evenly over --nnodes {nnodes}")
        accelerators = check_slots(nproc // nnodes, "-n / --nnodes")
    return accelerators, nnodes


def _job_hosts(args: argparse.Namespace, environ: Mapping[str, str], files: Files
               ) -> tuple[tuple[HostSpec, ...], str | None]:
    """(hosts from -H, the hostfile's lines or the allocation, else this host; the
    allocation's name or None), for a job that one ddlrun starts."""
    if args.hosts:
        return parse_host_list(args.hosts), None
    if args.hostfile:
        return parse_hostfile(files.lines(args.hostfile, "--hostfile"), args.hostfile), None
    allocation = uses_allocation(args, environ)
    if allocation == "slurm":
        return slurm_hosts(environ), allocation
    if allocation == "lsf":
        return lsf_hosts(environ, lambda path: files.lines(path, envs.LSB_DJOB_HOSTFILE)
                         ), allocation
    slots = None if args.nproc is None else check_slots(args.nproc, "-n (this host)")
    return (HostSpec("localhost", slots),), None


def _auto_launcher(launcher: str, allocation: str | None, hosts: tuple[HostSpec, ...]) -> str:
    """``--launcher auto``'s pick, and the check that ``local`` has no remote host."""
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
    return launcher


def _rank_env(args: argparse.Namespace) -> tuple[tuple[str, str | None], ...]:
    """``-x KEY[=VAL]``: (name, value or None for this shell's)."""
    env = []
    for item in args.env:
        key, eq, val = item.partition("=")
        env.append((validate_env_name(key), val if eq else None))
    return tuple(env)


def _launch_options(args: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(
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


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str],
                     files: Files | None = None) -> Config:
    """The typed, validated config of the command line. Pure: the files it names (the
    hostfile, the rankfile, LSF's hostfile, the program's ``#!`` line) come read in
    ``files`` (``steps.read_files``), so a missing or unreadable one is the same one-line
    error there."""
    files = files or Files()
    nodes = parse_nnodes(args.nnodes)
    args = argparse.Namespace(**{**vars(args), "nnodes": nodes[1] if nodes else None})
    program = list(args.program)
    if program and program[0] == "--":
        program = program[1:]
    _check_values(args)
    launcher, _ = _launcher_asked(args)
    master_addr, master_port = args.master_addr, args.master_port
    if args.rdzv_endpoint:
        addr, port = parse_endpoint(args.rdzv_endpoint)
        master_addr = master_addr or addr
        master_port = master_port or port
    per_node = is_per_node(args)
    asked_port = master_port  # the rendezvous endpoint's, before per-node's default
    accelerators, nproc, nnodes = args.accelerators, args.nproc, None
    allocation = None
    if per_node:
        accelerators, nnodes = _per_node_layout(args, launcher, master_addr)
        nproc, hosts, launcher = None, (HostSpec("localhost"),), "local"
        master_port = master_port or FALLBACK_PORT  # every node must agree: no free pick
    else:
        hosts, allocation = _job_hosts(args, environ, files)
        if args.nnodes:
            if len(hosts) < args.nnodes:
                raise UsageError(f"--nnodes {args.nnodes}: only {len(hosts)} host(s) given")
            hosts = hosts[: args.nnodes]
    include = parse_selection(args.include, "--include") if args.include else ()
    exclude = parse_selection(args.exclude, "--exclude") if args.exclude else ()
    hosts = select_hosts(hosts, include, exclude)
    rankfile = (parse_rankfile(files.lines(args.rankfile, "--rankfile"), args.rankfile)
                if args.rankfile else ())
    env = _rank_env(args)
    launcher = _auto_launcher(launcher, allocation, hosts)
    python = sys.executable if launcher == "local" else args.remote_python
    program = program_argv(program, python, args.module, args.no_python,
                           bool(program) and files.runs_itself(program[0]))
    _check_run_values(args)
    max_restarts = parse_max_restarts(args.max_restarts, launcher, per_node, args.job_id)
    rendezvous = parse_node_rendezvous(args, nodes, per_node, max_restarts, master_addr,
                                       asked_port)
    elastic = parse_elastic(args, launcher, per_node, max_restarts, nproc)
    request = Request(
        program=tuple(program),
        hosts=hosts,
        nproc=nproc,
        accelerators=accelerators,
        mode=args.mode,
        racks=args.racks,
        aisles=args.aisles,
        ddloptions=tuple(args.ddloption),
        no_ddloptions=args.no_ddloptions,
        env=env,
        network_interface=args.network_interface,
        master_addr=master_addr,
        tcp=args.tcp,
        rankfile=rankfile,
        bind_gpus=args.bind_gpus,
        include=include,
        exclude=exclude,
        nnodes=nnodes,
        node_rank=(args.node_rank or 0) if per_node else None,
    )
    _check_grid_fits(request, elastic, rendezvous, env, environ)
    return Config(
        request=request,
        options=_launch_options(args),
        launcher=launcher,
        dry_run=args.dry_run,
        check=args.check,
        cleanup=args.cleanup,
        preflight=not args.no_preflight,
        log_dir=args.log_dir,
        timeout=args.timeout,
        # with the rendezvous it is the endpoint's; each round's ranks get one node 0 picks
        master_port=None if rendezvous is not None else master_port,
        job_id=args.job_id,
        verbose=bool(args.verbose),
        per_node=per_node,
        max_restarts=max_restarts,
        output_ranks=args.output_ranks,
        elastic=elastic,
        rendezvous=rendezvous,
    )


def files_named(args: argparse.Namespace, environ: Mapping[str, str]
                ) -> tuple[list[tuple[str, str]], str | None]:
    """The files ``config_from_args`` needs read (``steps.read_files``): ([(path, what)],
    the ``.py`` program whose ``#!`` line decides whether it needs python)."""
    named = []
    if args.hostfile and not args.hosts:
        named.append((args.hostfile, "--hostfile"))
    if args.rankfile:
        named.append((args.rankfile, "--rankfile"))
    lsf_file = environ.get(envs.LSB_DJOB_HOSTFILE)
    if lsf_file and uses_allocation(args, environ) == "lsf":
        named.append((lsf_file, ""))
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    script = program[0] if program and program[0].endswith(".py") else None
    return named, None if args.module or args.no_python else script
