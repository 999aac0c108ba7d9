"""A job's janitor: remove the job's shared memory on this host when ddlrun dies.

ddlrun starts it as ``python -I -S janitor.py`` in a session of its own (``shm.Janitor``)
and writes one JSON line to its stdin: ``core`` (the path of ``ddl/engines/orphans.py``,
whose rules decide what is the job's), ``job_id``, ``hosts`` (the host indexes whose ranks
run here) and ``secret`` (hex, or null). Then the janitor reads until end of file:

- ``done``: ddlrun ended the job itself (and cleaned up): exit at once.
- anything else, or nothing: ddlrun died (SIGKILL, the OOM killer). Its ranks die with it
  (``PR_SET_PDEATHSIG``) before they can unlink their ``ddl.malloc`` heaps, a little after
  the pipe closed, so the job's segments are removed now and again over ``SWEEPS`` (one a
  rank made in its last moment). One line on stderr says what was removed and what was
  left alone (a file that is not provably the job's).

Standard library only, run by path: ``-I -S`` keeps its start near 20 ms, and it must work
where ``import ddl`` would not.
"""

import importlib.util
import json
import os
import sys
import time

SWEEPS = (0.0, 0.1, 0.3, 0.6, 1.0)  # seconds after ddlrun's death


def _load(path: str):
    spec = importlib.util.spec_from_file_location("_janitor_orphans", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def sweep(core, job_id: str, hosts: list, secret) -> tuple[int, int, dict]:
    """Removes the job's segments over ``SWEEPS``: (segments removed, their bytes,
    {name: why it was left alone})."""
    count = freed = 0
    left = {}
    start = time.monotonic()
    for at in SWEEPS:
        time.sleep(max(0.0, start + at - time.monotonic()))
        for host in hosts:
            result = core.remove_job(job_id, host, secret)
            count += len(result.removed)
            freed += result.freed
            left.update(result.left)
    still = set(core.job_names(job_id, None))
    return count, freed, {name: why for name, why in left.items() if name in still}


def main() -> int:
    line = sys.stdin.buffer.readline()
    if not line.endswith(b"\n"):
        return 0  # ddlrun died before it said which job
    spec = json.loads(line)
    if sys.stdin.buffer.read() == b"done":
        return 0
    core = _load(spec["core"])  # only now: a job that ends well waits for nothing of it
    secret = bytes.fromhex(spec["secret"]) if spec["secret"] else None
    count, freed, left = sweep(core, spec["job_id"], spec["hosts"], secret)
    notes = []
    if count:
        notes.append(f"the launcher of job {spec['job_id']} died: its janitor removed {count} "
                     f"shared-memory segment(s) on this host ({freed / 2**20:.1f} MiB)")
    if left:
        result = core.JobCleanup(spec["job_id"], (), tuple(sorted(left.items())))
        notes.append(result.left_line())
    try:
        for note in notes:
            os.write(2, f"ddlrun: {note}\n".encode())
    except OSError:
        pass  # nobody reads ddlrun's stderr any more
    return 0


if __name__ == "__main__":
    sys.exit(main())
