"""Backends: one class each, ``get_cmd()`` returns argv lists (tests assert on them
without launching), ``start(plan, sink, emit)`` runs, ``close(timeout)`` tears down."""

from __future__ import annotations

from ..errors import UsageError
from .base import Backend, LaunchOptions, check_path, is_root, ssh_options
from .local import LocalBackend
from .lsf import LsfBackend
from .mpirun import MpirunBackend
from .slurm import SlurmBackend
from .ssh import SshBackend

__all__ = ["Backend", "LaunchOptions", "check_path", "get_backend", "is_root", "ssh_options"]


def get_backend(name: str, opts: LaunchOptions) -> Backend:
    classes = {c.name: c for c in (LocalBackend, SshBackend, MpirunBackend, SlurmBackend,
                                   LsfBackend)}
    if name not in classes:
        raise UsageError(f"--launcher {name!r}: choose from {', '.join(sorted(classes))}")
    return classes[name](opts)
