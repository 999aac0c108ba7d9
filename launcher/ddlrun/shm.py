"""Shared-memory cleanup for a job on one host: ``ddl.engines.segments.cleanup_job``,
with a fallback of the same naming rule when the ddl core is not importable there."""

from __future__ import annotations

import os
import re

_JOB_ID = re.compile(r"^[A-Za-z0-9_.]{1,64}$")


def cleanup(job_id: str, host_index: int | None) -> list[str]:
    try:
        from ddl.engines.segments import cleanup_job
    except ImportError:
        return _fallback(job_id, host_index)
    return cleanup_job(job_id, host_index)


def _fallback(job_id: str, host_index: int | None, shm_dir: str = "/dev/shm") -> list[str]:
    if not _JOB_ID.match(job_id):
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
