"""The launcher's typed configuration: what ``cli.config_from_args`` makes of the
command line, and what the steps (``steps``) read."""

from __future__ import annotations

from dataclasses import dataclass

from .backends.base import LaunchOptions
from .plan import Request


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
