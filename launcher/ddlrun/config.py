"""The launcher's typed configuration: what ``configure.config_from_args`` makes of the
command line, and what the steps (``steps``) read; ``Files``: what the files the command
line names hold, read by ``steps.read_files`` before it (``config_from_args`` reads none)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .backends.base import LaunchOptions
from .plan import Request


@dataclass(frozen=True)
class Elastic:
    """Horovod's elastic settings (``--min-np``, ``--max-np``, ``--host-discovery-script``
    and the rest): the job re-forms its world in place when ranks are lost or hosts come."""

    min_np: int
    max_np: int
    discovery_script: str | None = None  # absolute path; None: the hosts given, fixed
    slots: int | None = None
    timeout: float = 600.0
    reset_limit: int | None = None
    cooldown: tuple[float, float] | None = None
    discovery_interval: float = 3.0
    discovery_timeout: float = 10.0


@dataclass(frozen=True)
class NodeRendezvous:
    """torchrun's elastic shape (``--nnodes MIN:MAX``, ``--max-restarts`` with one ddlrun
    per node): the ddlruns meet at ``host:port`` (``--rdzv-endpoint``; the one on that host
    serves it) and form each round of the job there (``node_rdzv``). The timeouts are
    torchrun's ``--rdzv-conf`` keys, with its defaults."""

    min_nodes: int
    max_nodes: int
    host: str
    port: int
    join_timeout: float = 600.0
    last_call: float = 30.0
    close_timeout: float = 30.0


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
    per_node: bool = False  # one ddlrun per node (--nnodes/--node-rank, torchrun-style)
    max_restarts: int = 0  # --max-restarts: starts of the whole job after a failure
    output_ranks: frozenset[int] | None = None  # --output-ranks: shown on the terminal
    elastic: Elastic | None = None  # --min-np/--max-np/--host-discovery-script
    rendezvous: NodeRendezvous | None = None  # one ddlrun per node, restarting together


@dataclass(frozen=True)
class Files:
    """The files a command line names, read: each path's lines (a hostfile, a rankfile,
    LSF's hostfile) and the programs that run themselves (an executable with a ``#!``
    line: ``ddlrun train.py`` then needs no interpreter)."""

    texts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    self_running: frozenset[str] = frozenset()

    def lines(self, path: str, what: str) -> list[str]:
        if path not in self.texts:
            raise LookupError(f"{what} {path} was not read (steps.read_files reads it)")
        return list(self.texts[path])

    def runs_itself(self, program: str) -> bool:
        return program in self.self_running
