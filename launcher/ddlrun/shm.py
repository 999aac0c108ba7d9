"""Shared-memory cleanup on one host: a job's segments (``cleanup``), the orphans of killed
jobs (``sweep_orphans``), and the janitor that removes a job's segments when ddlrun itself
is killed (``Janitor``).

Which files are a job's, how its segments are named and what marks them all live in one
standard-library file, ``ddl/engines/orphans.py``; ddlrun reaches it through ``core``,
which loads it by path where ``import ddl`` fails, so a host with a broken ddl still gets
the same rules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping

from . import core

JANITOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "janitor.py")


def job_secret(env: Mapping[str, str]) -> bytes | None:
    """The secret ranks started with ``env`` have (``DDL_JOB_SECRET`` or the file
    ``DDL_JOB_SECRET_FILE``), read by ddl's own rule; None when there is none, or it cannot
    be read here (the ranks then fail on it themselves)."""
    identity, errors = core.identity(), core.errors()
    if identity is None or errors is None:  # left to the ranks
        return None
    try:
        return identity.job_secret(env)
    except errors.DDLError:
        return None


def _stderr_note(text: str) -> None:
    sys.stderr.write(f"ddlrun: {text}\n")
    sys.stderr.flush()


def cleanup(job_id: str, host_index: int | None, secret: bytes | None = None,
            note: Callable[[str], None] | None = None) -> list[str]:
    """Remove the job's segments on this host (one host index, or all): only those provably
    the job's (our uid, mode 0600, the job's token, and the name's key when the job has a
    ``secret``; without it, a keyed name only when no process maps it). What is left alone
    is reported in one line through ``note`` (default: stderr). The names removed."""
    result = core.require_orphans().remove_job(job_id, host_index, secret)
    line = result.left_line()
    if line:
        (note or _stderr_note)(line)
    return list(result.removed)


def sweep_orphans() -> list[tuple[str, int]]:
    """Remove this user's orphaned segments on this host: (name, bytes) of each removed.
    Never fails: a sweep that cannot run must not stop a job from starting."""
    orphans = core.orphans()
    if orphans is None:
        return []
    try:
        return [(o.name, o.size) for o in orphans.remove(orphans.scan())]
    except OSError:
        return []


orphans_module = core.orphans  # the names this module had before ``core``
core_path = core.orphans_path


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class Janitor:
    """Removes the job's segments on this host the moment ddlrun dies without doing so.

    ``kill -9`` of ddlrun (or the OOM killer) takes its ranks with it (``PR_SET_PDEATHSIG``)
    before they can unlink their ``ddl.malloc`` heaps, which would hold /dev/shm until a
    later sweep. The janitor (``janitor.py``, one small process per job, in a session of its
    own so that a signal to ddlrun's process group spares it) waits on a pipe only ddlrun
    holds, as Horovod's ``safe_shell_exec`` watches its parent: ddlrun's end of the job
    writes ``done`` and the janitor exits at once; end of file without ``done`` means ddlrun
    died, and the janitor removes the job's segments of ``host_indexes`` (by the rules of
    ``cleanup``, with the job's secret, which reaches it through the pipe, never its
    command line), reports in one line on ddlrun's stderr, and exits."""

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc

    @classmethod
    def start(cls, job_id: str, host_indexes: Iterable[int], secret: bytes | None
              ) -> Janitor | None:
        """The janitor of a job, or None where it cannot run (no ddl core here, no fork)."""
        path = core.orphans_path()
        if path is None:
            return None
        spec = {"core": path, "job_id": job_id, "hosts": sorted(set(host_indexes)),
                "secret": secret.hex() if secret else None}
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", JANITOR], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            return None
        try:
            proc.stdin.write(json.dumps(spec).encode() + b"\n")
            proc.stdin.flush()
        except OSError:  # it died already: nothing to watch with
            proc.kill()
            proc.wait()
            return None
        return cls(proc)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def finish(self, timeout: float = 5.0) -> None:
        """ddlrun is alive at the job's end: the janitor exits without removing anything."""
        try:
            self._proc.stdin.write(b"done")
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
