"""ddlrun's command line as a grammar: ``build_parser()`` and ``parse_args(argv)``, with no
meaning given to the values yet (``ddlrun.configure`` turns them into a ``Config``).

Peer launchers' spellings (torchrun, horovodrun, mpirun, DeepSpeed, IBM ddlrun) are
aliases of the same option, accepted where they mean what ddlrun does (``_Choice``:
``--bind-to none``), or rejected in one line naming ddlrun's (``_Reject``). ``-m`` is
torchrun's ``--module``; ddl's mode is ``--mode`` (IBM's ``-mode``). Options are never
abbreviated, an unknown single-dash word is never a short option with a value glued on
(``_check_merged``: ``-npernodes`` is not ``-n pernodes``), and ``--ddloption``/``--mpiarg``
values may start with '-' (``join_dash_values``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from . import check_build, version
from .errors import UsageError
from .output import parse_ranks

LAUNCHERS = ("auto", "local", "ssh", "mpirun", "slurm", "lsf")


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
    """ddlrun's parser: every option and its aliases (never abbreviated), then the program."""
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
    g.add_argument("--nnodes", "--num_nodes", "--num-nodes", dest="nnodes",
                   metavar="N", help="with -H/--hostfile: use the first N hosts; without: "
                   "one ddlrun per node, torchrun-style (with --node-rank, --master-addr); "
                   "torchrun's MIN:MAX: nodes meeting at --rdzv-endpoint (docs/elastic.md)")
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
                   help="torchrun's: accepted; ddlrun's rendezvous is always rank 0's host, "
                   "or with --nnodes MIN:MAX / --max-restarts the --rdzv-endpoint host's")
    e.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", metavar="K=V,...",
                   help="torchrun's: join_timeout (600), last_call_timeout (30), "
                   "close_timeout (30) seconds, for --nnodes MIN:MAX / --max-restarts")
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
    r.add_argument("--diagnose", nargs="?", const="", metavar="JOB",
                   help="ask a running job's ranks on this host what they are doing (their "
                   "flight recorders and stacks; py-spy when installed) without stopping "
                   "them, and exit; without JOB: the only job here with live ranks")
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
                   "job again, up to N times (default 0; one host, or one ddlrun per node)")
    el = p.add_argument_group("elastic training (Horovod's; docs/elastic.md)")
    el.add_argument("--min-np", "--min_np", dest="min_np", type=int, metavar="N",
                    help="elastic: go on while at least N ranks are left (default: -np)")
    el.add_argument("--max-np", "--max_np", dest="max_np", type=int, metavar="N",
                    help="elastic: never more than N ranks, however many slots are found "
                    "(default: -np)")
    el.add_argument("--host-discovery-script", "--host_discovery_script",
                    dest="host_discovery_script", metavar="SCRIPT",
                    help="elastic: an executable printing the available hosts, one "
                    "'host[:slots]' a line; ddlrun runs it again every few seconds")
    el.add_argument("--slots", "--slots-per-host", dest="slots", type=int, metavar="N",
                    help="elastic: slots of a discovered host that prints no ':slots'")
    el.add_argument("--elastic-timeout", "--elastic_timeout", dest="elastic_timeout",
                    type=float, metavar="SECONDS",
                    help="elastic: how long workers wait for the next world (default 600)")
    el.add_argument("--reset-limit", "--reset_limit", dest="reset_limit", type=int,
                    metavar="N", help="elastic: fail after the world was re-formed N times "
                    "(default: no limit)")
    el.add_argument("--blacklist-cooldown-range", "--blacklist_cooldown_range",
                    dest="blacklist_cooldown_range", type=float, nargs=2,
                    metavar=("MIN", "MAX"),
                    help="elastic: a failed slot or lost host may come back after a "
                    "cooldown between MIN and MAX seconds (growing with each failure); "
                    "default: never")
    el.add_argument("--discovery-interval", dest="discovery_interval", type=float,
                    default=3.0, metavar="SECONDS",
                    help="elastic: seconds between runs of the discovery script (default 3)")
    a("-v", "--verbose", action="count", default=0,
      help="print the plan and commands (-vv: the same; mpirun's habit)")
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
    """``argv`` (default: this process's) parsed by ``parser`` (default: ``build_parser()``),
    ``--ddloption``/``--mpiarg`` values that start with '-' included."""
    parser = parser or build_parser()
    return parser.parse_args(join_dash_values(parser, sys.argv[1:] if argv is None else argv))
