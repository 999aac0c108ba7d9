"""The launcher's one door to the ddl core (``ddl``, shipped in the same distribution).

ddlrun also runs where ``import ddl`` fails (numpy missing, a broken install, a host that
only launches): every use of the core goes through this module, and each use follows one
of three policies, stated where it is used:

- **needed**: without the core ddlrun stops with one LaunchError line that names what
  needed it and the fix (``require``; the default mode, the job-id rule);
- **left to the ranks**: the check is skipped here and the workers' ddl makes it when it
  starts (the ``-mode`` grammar, ddl's variables, the staging size, the job's secret);
- **the same rule without ddl**: the standard-library file ``ddl/engines/orphans.py``
  loaded by path (shared-memory names, the job-id pattern; ``orphans``), or a secret drawn
  with ``secrets`` (``new_secret``).

Each accessor imports on every call (cheap once ``sys.modules`` holds it) and returns None
when the import fails, so a test can take ddl away with a patched ``__import__``.
``check_probes`` is the exception: it imports ddl on purpose to report why it fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import sys
from types import ModuleType

from .errors import LaunchError, UsageError

REINSTALL = "reinstall powerddl"


def available() -> bool:
    """Whether ``import ddl`` works here."""
    try:
        import ddl  # noqa: F401
    except ImportError:
        return False
    return True


def require(module: ModuleType | None, what: str, fix: str = REINSTALL) -> ModuleType:
    """``module``, or the LaunchError of a launcher that needs the core for ``what``."""
    if module is None:
        raise LaunchError(f"ddlrun: cannot import ddl for {what}: {fix}")
    return module


# ------------------------------------------------------------------ the core's modules
def options() -> ModuleType | None:
    """``ddl.options``: the default mode and the ``-mode`` grammar."""
    try:
        from ddl import options
    except ImportError:
        return None
    return options


def config() -> ModuleType | None:
    """``ddl.config``: ddl's variables (the registry, their rules, the store port)."""
    try:
        from ddl import config
    except ImportError:
        return None
    return config


def errors() -> ModuleType | None:
    """``ddl.errors``: ``DDLError`` and ``DDLConfigError``, what the core's rules raise."""
    try:
        from ddl import errors
    except ImportError:
        return None
    return errors


def identity() -> ModuleType | None:
    """``ddl.identity``: the job's secret, drawn and read by ddl's rules."""
    try:
        from ddl import identity
    except ImportError:
        return None
    return identity


def rendezvous() -> ModuleType | None:
    """``ddl.rendezvous``: the store an elastic job's driver keeps (needed there)."""
    try:
        from ddl import rendezvous
    except ImportError:
        return None
    return rendezvous


def shm_engine() -> ModuleType | None:
    """``ddl.engines.shm``: the staging size of the shared-memory engine."""
    try:
        from ddl.engines import shm
    except ImportError:
        return None
    return shm


# ------------------------------------------------------- the same rule without ddl
def orphans() -> ModuleType | None:
    """``ddl.engines.orphans`` (shared-memory names, marks and the job-id pattern); when
    ``import ddl`` fails here the same standard-library file loaded on its own; None when
    ddl is not installed at all."""
    try:
        from ddl.engines import orphans
    except ImportError:
        pass
    else:
        return orphans
    path = orphans_path()
    if path is None:
        return None
    file_spec = importlib.util.spec_from_file_location("_ddlrun_orphans", path)
    if file_spec is None or file_spec.loader is None:
        return None
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[file_spec.name] = module  # dataclasses look their module up there
    file_spec.loader.exec_module(module)
    return module


def orphans_path() -> str | None:
    """The path of ``ddl/engines/orphans.py``, found without running ddl's ``__init__``."""
    try:
        spec = importlib.util.find_spec("ddl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "engines", "orphans.py")
    return path if os.path.exists(path) else None


def require_orphans() -> ModuleType:
    """``orphans()``, needed: ddl and ddlrun ship as one distribution, so a core that cannot
    even be loaded by path is a broken install."""
    module = orphans()
    if module is None:
        raise LaunchError("ddlrun: the ddl package is not installed next to ddlrun; "
                          f"{REINSTALL}")
    return module


def job_id_rule() -> re.Pattern[str]:
    """The job-id pattern, from its one copy (``ddl/engines/orphans.py``); needed."""
    return require_orphans().JOB_ID


def validate_job_id(job_id: str) -> str:
    """``job_id`` when it follows the core's rule, else one UsageError line."""
    if not job_id_rule().fullmatch(job_id):
        raise UsageError(f"job id {job_id!r} is invalid: 1-64 characters of [A-Za-z0-9_.]")
    return job_id


def new_secret() -> str:
    """A new job secret by ddl's rule; without ddl, the same strength from ``secrets``."""
    module = identity()
    return secrets.token_urlsafe(32) if module is None else module.new_secret()
