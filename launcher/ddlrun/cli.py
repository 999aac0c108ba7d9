"""ddlrun command line: ``build_parser()`` -> ``config_from_args()`` (typed, validated, no
side effects, no file read: the hostfile, rankfile and the program's ``#!`` line come read
by ``steps.read_files``) -> ``main()``: the steps of ``ddlrun.steps``, ``preflight()``
(probe the hosts), ``check_program()`` (a missing script or module, before any rank),
``job_inputs()`` (draw the job id, port and secret), ``plan_job()`` (pure), ``act()``
(print for --dry-run, or supervise), with one output sink.

Host precedence: ``-H`` or ``--hostfile`` (not both), else ``--nnodes N`` (> 1) or
``--node-rank K`` without hosts: one ddlrun per node, torchrun-style (this host's ranks only,
``RANK = K * nproc + local``, rendezvous at ``--master-addr``), else the Slurm/LSF allocation
ddlrun runs in, else this host (``-n N`` local ranks). ``--launcher auto`` picks slurm/lsf
inside an allocation, ssh when any host is not this one, local otherwise.

Peer launchers' spellings (torchrun, horovodrun, mpirun, DeepSpeed, IBM ddlrun) are
aliases of the same option, accepted where they mean what ddlrun does (``_Choice``:
``--bind-to none``), or rejected in one line naming ddlrun's (``_Reject``). ``-m`` is
torchrun's ``--module``; ddl's mode is ``--mode`` (IBM's ``-mode``). Options are never
abbreviated, an unknown single-dash word is never a short option with a value glued on
(``_check_merged``: ``-npernodes`` is not ``-n pernodes``), and ``--ddloption``/``--mpiarg``
values may start with '-' (``join_dash_values``).

Side effects live in the steps, not in the planner: the job id, the free port (a note when
it is a guess: ``steps.choose_port``), the job's secret (``steps.job_secret_env``) and the
sweep of orphaned shared memory at start.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence

from . import check_build, envs, version
from .backends import Backend, LaunchOptions, get_backend, is_root
from .backends.mpirun import parse_mpiargs
from .config import Config, Files
from .core import validate_job_id
from .errors import LaunchError, PreflightError, UsageError
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
from .output import OutputSink, parse_ranks, silence
from .plan import JobPlan, Request, attempt_job_id, parse_rankfile, validate_env_name
from .reaper import become_subreaper
from .run import Interrupted, signals_raise
from .steps import (
    FALLBACK_PORT,
    act,
    check_ddl_env,
    check_program,
    check_staging,
    job_inputs,
    plan_job,
    preflight,
    read_files,
    restart_inputs,
    run_cleanup,
)

LAUNCHERS = ("auto", "local", "ssh", "mpirun", "slurm", "lsf")
MAX_RESTARTS = 1_000_000  # keeps every restart's job id (``attempt_job_id``) within 64
IFACE = re.compile(r"[A-Za-z0-9_.-]{1,15}")  # a Linux interface name (IFNAMSIZ - 1)


class _Reject(argparse.Action):
    """A peer launcher's flag that ddlrun does not take: one line naming ddlrun's way."""

    def __init__(self, option_strings, dest, message: str = "", **kw) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, help=argparse.SUPPRESS)
        self.message = message

    def __call__(self, parser, namespace, values, option_string=None):
        raise UsageError(f"{option_string}: {self.message}")


class _Choice(argparse.Action):
    """A peer launcher's flag with a value: the values that mean what ddlrun does are
    accepted (and change nothing), any other is refused in one line naming ddlrun's way."""

    def __init__(self, option_strings, dest, accepted: tuple[str, ...] = (),
                 message: str = "", **kw) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, metavar=kw.get("metavar"),
                         help=argparse.SUPPRESS)
        self.accepted, self.message = accepted, message

    def __call__(self, parser, namespace, values, option_string=None):
        if values.lower() not in self.accepted:
            raise UsageError(f"{option_string} {values}: {self.message}")


def _per_host(text: str) -> int | None:
    """``--nproc-per-node N``; torchrun's ``gpu``/``auto`` mean ddlrun's default."""
    if text in ("gpu", "auto"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 'gpu' or 'auto', got {text!r}"
                                         ) from None


# options whose value may start with '-' ("--ddloption -dump_iter 100")
DASH_VALUES = ("--ddloption", "--mpiarg")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddlrun",
        description="Launch a distributed job on this host or many (local, ssh, mpirun, "
        "Slurm, LSF). Every rank gets the torchrun env contract plus DDL_OPTIONS.",
        epilog="example: ddlrun -H h1:4,h2:4 python train.py --epochs 3",
        allow_abbrev=False,
    )
    a = p.add_argument
    g = p.add_argument_group("where to run")
    g.add_argument("-n", "-np", "--num-proc", dest="nproc", type=int,
                   help="total ranks (default: all slots)")
    g.add_argument("-H", "--host", "--hosts", dest="hosts", metavar="HOST[:N],...",
                   help="hosts and slots")
    g.add_argument("--hostfile", help="file of 'host slots=N' or 'host:N' lines")
    g.add_argument("--accelerators", "--nproc-per-node", "--nproc_per_node", "--num_gpus",
                   "--num-gpus", "-npernode", "--npernode", "-N", dest="accelerators",
                   type=_per_host, metavar="N",
                   help="ranks per host (default, also 'gpu' or 'auto' as torchrun spells "
                   "it: slots, else GPUs detected, else 1 or -n)")
    g.add_argument("--nnodes", "--num_nodes", "--num-nodes", dest="nnodes", type=int,
                   metavar="N", help="with -H/--hostfile: use the first N hosts; without: "
                   "one ddlrun per node, torchrun-style (with --node-rank, --master-addr)")
    g.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, metavar="K",
                   help="this node's index (0..nnodes-1) when one ddlrun runs per node")
    g.add_argument("--standalone", action="store_true",
                   help="torchrun's single-node mode (what ddlrun does without hosts)")
    g.add_argument("--include", metavar="HOST[:IDS]@...",
                   help="DeepSpeed-style: only these hosts / GPUs, e.g. 'h1:0,1@h2'")
    g.add_argument("--exclude", metavar="HOST[:IDS]@...",
                   help="DeepSpeed-style: not these hosts / GPUs, e.g. 'h1:2'")
    g.add_argument("--bind-gpus", action="store_true",
                   help="set CUDA_VISIBLE_DEVICES to each rank's own GPU (default: leave it, "
                   "all GPUs visible, local_rank indexes them)")
    g.add_argument("--rankfile", help="Open MPI rankfile ('rank N=host slot=S') placing ranks")
    g.add_argument("--launcher", choices=LAUNCHERS, default=None,
                   help="auto (default), local, ssh, mpirun, slurm, lsf")
    g.add_argument("--gloo", dest="launcher_alias", action="store_const", const="gloo",
                   help="horovodrun's --gloo: ddlrun's own launchers (local / ssh), no mpirun")
    g.add_argument("--mpi", dest="launcher_alias", action="store_const", const="mpirun",
                   help="horovodrun's --mpi: same as --launcher mpirun")
    g.add_argument("--oversubscribe", action=_Reject,
                   message="not needed: ddlrun never binds ranks to cores; give the ranks "
                   "per host with -H host:N, a hostfile's slots=N or --accelerators N")
    g.add_argument("--bind-to", action=_Choice, metavar="none",
                   accepted=("none",), message="ddlrun never binds ranks to cores (only "
                   "GPUs: --bind-gpus); give --bind-to none or leave it out")
    g.add_argument("--map-by", action=_Choice, metavar="slot",
                   accepted=("slot",), message="ddlrun places ranks by slot (each host's "
                   "slots in turn, as --map-by slot); for N ranks per host give --npernode N, "
                   "for any other placement --rankfile FILE")
    d = p.add_argument_group("DDL topology")
    d.add_argument("--mode", "-mode", help="DDL mode letters (r,n,b,p) or a full spec "
                   "'b:4x2' (IBM ddlrun's -mode; -m is torchrun's --module)")
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
    e.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                   help="rendezvous port (default: a free one; 29500 with one ddlrun per node)")
    e.add_argument("--master-addr", "--master_addr", dest="master_addr",
                   help="rendezvous address (default: host 0's)")
    e.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                   metavar="HOST[:PORT]", help="torchrun's: same as --master-addr/--master-port")
    e.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
                   choices=("c10d", "static"),
                   help="torchrun's: accepted; ddlrun's rendezvous is always rank 0's host")
    e.add_argument("--job-id", "--rdzv-id", "--rdzv_id", dest="job_id",
                   help="job id (default: time + random)")
    e.add_argument("--tcp", action="store_true",
                   help="TCP only: NCCL_IB_DISABLE=1, mpirun btl tcp")
    c = p.add_argument_group("ssh / mpirun")
    c.add_argument("-p", "--ssh-port", "--ssh_port", dest="ssh_port", type=int)
    c.add_argument("--ssh-identity", metavar="KEYFILE")
    c.add_argument("--ssh-config", metavar="FILE", help="ssh -F config file")
    c.add_argument("--remote-python", default=sys.executable,
                   help="python with powerddl on the remote hosts (default: this one's path)")
    c.add_argument("--mpiarg", action="append", default=[], help="extra mpirun/srun arguments")
    r = p.add_argument_group("run")
    r.add_argument("--dry-run", action="store_true",
                   help="print every rank's argv, cwd and env and the commands; start nothing")
    r.add_argument("--check", action="store_true", help="preflight only")
    r.add_argument("--cleanup", action="store_true",
                   help="remove shared memory of killed jobs on this host (with --job-id: "
                   "all of that job's) and exit")
    r.add_argument("--check-build", action="store_true",
                   help="print what this host can run (frameworks, engines, launchers, GPUs, "
                   "/dev/shm) and exit; horovodrun's --check-build")
    r.add_argument("--json", action="store_true", help="with --check-build: one JSON object")
    r.add_argument("--require", action="append", default=[], metavar="NAME[,NAME]",
                   help="with --check-build: exit 3 when one is missing (repeatable; "
                   f"{', '.join(check_build.REQUIREMENTS)})")
    r.add_argument("--no-preflight", action="store_true", help="skip the preflight at start")
    r.add_argument("--log-dir", help="write per-rank stdout/stderr under DIR/<job id>/")
    r.add_argument("--tag-output", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix lines with [rank] (default: on)")
    r.add_argument("--output-ranks", "--local-ranks-filter", "--local_ranks_filter",
                   dest="output_ranks", type=parse_ranks, metavar="LIST",
                   help="show only these ranks' output, e.g. 0 or 0,2-3 (torchrun's "
                   "--local-ranks-filter, but global ranks); a failing rank is always "
                   "reported")
    r.add_argument("--timeout", type=float, help="seconds for the whole job")
    r.add_argument("--start-timeout", type=float, default=30.0,
                   help="seconds for ssh/preflight per host (default 30)")
    r.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL at teardown (default 5)")
    r.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", metavar="N",
                   help="torchrun's: when a rank fails, stop every rank and start the whole "
                   "job again, up to N times (default 0; local launcher only)")
    a("-v", "--verbose", action="store_true", help="print the plan and commands")
    a("--version", action="version", version=f"ddlrun (powerddl) {version()}")
    r.add_argument("-m", "--module", action="store_true",
                   help="torchrun's: the program is a python module, run as 'python -m "
                   "MODULE args' on every rank")
    r.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                   help="torchrun's: run the program as it is, never with python (even a "
                   "'.py' file)")
    a("program", nargs=argparse.REMAINDER, help="program and its arguments")
    return p


def join_dash_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--ddloption -dump_iter 100`` -> ``--ddloption=-dump_iter 100``: argparse reads a
    value that starts with '-' as an option. Only ddlrun's own options are rewritten: the
    scan stops where the program begins."""
    out, args, i = [], list(argv), 0
    actions = parser._option_string_actions
    while i < len(args):
        tok = args[i]
        if tok == "--" or not tok.startswith("-") or tok == "-":
            return out + args[i:]
        action = actions.get(tok)
        if action is None:
            _check_merged(actions, tok)
        if action is not None and action.nargs != 0 and i + 1 < len(args):
            if tok in DASH_VALUES:
                out.append(f"{tok}={args[i + 1]}")
            else:
                out += [tok, args[i + 1]]
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def _check_merged(actions: Mapping[str, argparse.Action], tok: str) -> None:
    """A single-dash word ddlrun does not know (``-npernodes``, ``-bind-to``) is not read
    as a short option with its value glued on (``-n pernodes``), argparse's habit: only a
    value that fits the short option is (``-n4``, ``-Hh1:2``, ``-xKEY=1``)."""
    if tok.startswith("--") or len(tok) < 3 or tok.partition("=")[0] in actions:
        return  # a long option, or one with its value after '=' (-mode=b)
    short = actions.get(tok[:2])
    if short is None:
        return
    glued = tok[2:]
    if short.nargs == 0 or (short.type in (int, float, _per_host) and not glued[0].isdigit()):
        raise UsageError(f"unknown option {tok} (ddlrun --help lists them)")


def parse_args(argv: Sequence[str] | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    parser = parser or build_parser()
    return parser.parse_args(join_dash_values(parser, sys.argv[1:] if argv is None else argv))


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
    if count and (launcher != "local" or per_node):
        where = ("one ddlrun per node (--nnodes/--node-rank)" if per_node
                 else f"--launcher {launcher}")
        raise UsageError(f"--max-restarts {count}: restarts are not supported with {where} "
                         "yet, only with the local launcher (one host); drop --max-restarts")
    if count and job_id is not None:
        last = attempt_job_id(validate_job_id(job_id), count)
        try:
            validate_job_id(last)
        except UsageError:
            raise UsageError(f"--job-id {job_id!r} is too long for --max-restarts {count}: "
                             f"the last restart's job id {last!r} must fit 64 characters"
                             ) from None
    return count


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
                         "--master-addr (node 0's address, the same on every node)")
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
        master_port=master_port,
        job_id=args.job_id,
        verbose=args.verbose,
        per_node=per_node,
        max_restarts=max_restarts,
        output_ranks=args.output_ranks,
    )


# ---------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    become_subreaper()  # before any fork: the ranks' orphans come to us (reaper.py)
    parser = build_parser()
    try:
        try:
            args = parse_args(argv, parser)
        except UsageError as exc:  # a peer launcher's flag that ddlrun spells otherwise
            OutputSink().note(f"error: {exc}")
            return exc.exit_code
        sink = OutputSink(tag=args.tag_output, ranks=args.output_ranks)  # the run's one sink
        return _main(parser, args, sink)
    except BrokenPipeError:  # ddlrun --dry-run ... | head -1
        silence(sys.stdout)
        return 141  # 128 + SIGPIPE, what a shell shows for a writer whose reader left


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


def warn_unset(cfg: Config, environ: Mapping[str, str], sink: OutputSink) -> None:
    for key, value in cfg.request.env:
        if value is None and key not in environ:
            sink.note(f"warning: -x {key}: {key} is not set here, so it is not exported "
                      f"(set it, or give -x {key}=VALUE)")


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace, sink: OutputSink) -> int:
    """The modes that run no job (--check-build, --cleanup), then preflight, plan, act."""
    try:
        if args.check_build:
            if args.program:
                raise UsageError("--check-build runs no program: ddlrun --check-build "
                                 "[--json] [--require NAME]")
            return check_build.run(args.json, args.require, sink.note)
        if args.json or args.require:
            raise UsageError("--json and --require go with --check-build")
        cfg = config_from_args(args, os.environ, read_files(*files_named(args, os.environ)))
        if cfg.cleanup:
            return run_cleanup(cfg.job_id, sink)
        if not cfg.request.program and not cfg.check:
            parser.print_usage(sys.stderr)
            raise UsageError("no program given: ddlrun [options] program [args...]")
        warn_unset(cfg, os.environ, sink)
        check_ddl_env(cfg, os.environ)
        backend = get_backend(cfg.launcher, cfg.options)
        with signals_raise():  # Ctrl-C while hosts are probed: no traceback, no ssh left
            facts = preflight(cfg, backend, sink, os.environ)
        if cfg.check:
            return 0
        if not cfg.dry_run:
            check_program(cfg, os.environ)
        inputs = job_inputs(cfg, facts, os.environ)
        for note in inputs.notes:
            sink.note(note)
        plan = plan_job(cfg, facts, inputs, os.environ)
        check_staging(cfg, plan, os.environ)
        backend.validate(plan)

        def next_attempt(attempt: int) -> tuple[JobPlan, Backend]:  # --max-restarts
            again = plan_job(cfg, facts, restart_inputs(cfg, inputs, attempt, os.environ),
                             os.environ)
            fresh = get_backend(cfg.launcher, cfg.options)
            fresh.validate(again)
            return again, fresh

        return act(cfg, plan, backend, sink, next_attempt)
    except PreflightError as exc:
        if exc.table and not (args.check or args.verbose):
            print(exc.table, file=sys.stderr)
        for problem in exc.problems:
            sink.note(f"preflight: {problem}")
        return exc.exit_code
    except LaunchError as exc:
        sink.note(f"error: {exc}")
        return exc.exit_code
    except Interrupted as exc:
        sink.note(f"{exc}: stopped during the preflight; no rank was started")
        return 128 + exc.signum
