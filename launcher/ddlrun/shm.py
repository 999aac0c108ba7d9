"""Shared-memory cleanup on one host: a job's segments (``ddl.engines.segments.cleanup_job``)
and the orphans of killed jobs (``ddl.engines.orphans``), with fallbacks for hosts where the
ddl core is not importable (the same naming rule; the orphan scan is standard library only,
so it is loaded from its file without the rest of ddl)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from types import ModuleType

from .errors import LaunchError


def job_id_rule() -> re.Pattern[str]:
    """The job-id rule, from its one copy in ``ddl/engines/orphans.py`` (standard library
    only, so it loads where ``import ddl`` fails). ddl and ddlrun ship as one distribution:
    a missing core is a broken install."""
    orphans = orphans_module()
    if orphans is None:
        raise LaunchError("ddlrun: the ddl package is not installed next to ddlrun; "
                          "reinstall powerddl")
    return orphans.JOB_ID


def cleanup(job_id: str, host_index: int | None) -> list[str]:
    try:
        from ddl.engines.segments import cleanup_job
    except ImportError:
        return _fallback(job_id, host_index)
    return cleanup_job(job_id, host_index)


def _fallback(job_id: str, host_index: int | None, shm_dir: str = "/dev/shm") -> list[str]:
    if not job_id_rule().match(job_id):
        return []
    prefix = f"ddl-{job_id}-h" + ("" if host_index is None else f"{host_index}-")
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    for n in names:
        if not n.startswith(prefix):
            continue
        if host_index is None and not n[len(prefix):].split("-", 1)[0].isdigit():
            continue
        try:
            os.unlink(os.path.join(shm_dir, n))
            removed.append(n)
        except OSError:
            pass
    return sorted(removed)


def orphans_module() -> ModuleType | None:
    """``ddl.engines.orphans``; when ``import ddl`` fails here (numpy missing, a broken
    install) the same file loaded on its own; None when ddl is not installed at all."""
    try:
        from ddl.engines import orphans
    except ImportError:
        pass
    else:
        return orphans
    try:
        spec = importlib.util.find_spec("ddl")  # finds the package without running it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "engines", "orphans.py")
    file_spec = importlib.util.spec_from_file_location("_ddlrun_orphans", path)
    if file_spec is None or file_spec.loader is None or not os.path.exists(path):
        return None
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[file_spec.name] = module  # dataclasses look their module up there
    file_spec.loader.exec_module(module)
    return module


def sweep_orphans() -> list[tuple[str, int]]:
    """Remove this user's orphaned segments on this host: (name, bytes) of each removed.
    Never fails: a sweep that cannot run must not stop a job from starting."""
    orphans = orphans_module()
    if orphans is None:
        return []
    try:
        return [(o.name, o.size) for o in orphans.remove(orphans.scan())]
    except OSError:
        return []


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
