"""Shared-memory segments that no process uses any more: what a job leaves in /dev/shm when
it is killed outright (SIGKILL of ddlrun: its ranks die of PR_SET_PDEATHSIG, before they can
unlink their ``ddl.malloc`` heaps).

A segment is an orphan when it

- is named like ours (``ddl-<job id>-h<host index>-<what>``), is a regular file and belongs
  to our uid,
- is mapped by no process we can see (``/proc/*/maps``, matched by device and inode, so a
  process in another mount namespace counts too), and
- was last modified more than ``grace`` seconds ago: between ``create`` and ``mmap`` a live
  job's segment is mapped by nobody yet.

Every live job maps each of its segments at least in the process that created it, for the
segment's whole life, so a live job's segments are never orphans. Only processes in our PID
namespace are visible: on hosts where containers of another PID namespace share this
/dev/shm (``--ipc=host``), run the sweep inside the container that runs the jobs.

Standard library only: ddlrun imports this on hosts where the rest of ddl may not work.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
PROC_DIR = "/proc"
GRACE = 10.0  # seconds

# The job-id rule, the one copy: ``segments.validate_job_id`` (the core) and ddlrun (through
# ``ddlrun.shm.job_id_rule``, which loads this file even where ``import ddl`` fails) use it.
JOB_ID_CHARS = "[A-Za-z0-9_.]{1,64}"
JOB_ID = re.compile(f"^{JOB_ID_CHARS}$")
_NAME = re.compile(rf"^ddl-({JOB_ID_CHARS})-h(\d+)-.+$")


@dataclass(frozen=True)
class Orphan:
    name: str  # file name under the shm directory
    job_id: str
    host_index: int
    size: int  # bytes
    mtime: float


def _ours(shm_dir: str, uid: int) -> dict[tuple[int, int], Orphan]:
    """Our uid's ddl segments, by (device, inode)."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return {}
    found = {}
    for name in names:
        m = _NAME.match(name)
        if not m:
            continue
        try:
            st = os.lstat(os.path.join(shm_dir, name))
        except OSError:
            continue  # removed meanwhile
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            continue
        found[(st.st_dev, st.st_ino)] = Orphan(name, m.group(1), int(m.group(2)), st.st_size,
                                               st.st_mtime)
    return found


def _parse_dev(text: str) -> int | None:
    """``/proc/PID/maps``' device field (hex ``major:minor``) as an ``st_dev``."""
    major, sep, minor = text.partition(":")
    try:
        return os.makedev(int(major, 16), int(minor, 16)) if sep else None
    except ValueError:
        return None


def mapped_files(proc_dir: str = PROC_DIR) -> set[tuple[int, int]]:
    """(device, inode) of every file mapped by a process whose maps we can read."""
    try:
        pids = [d for d in os.listdir(proc_dir) if d.isdigit()]
    except OSError:
        return set()
    seen: set[tuple[int, int]] = set()
    for pid in pids:
        try:
            with open(os.path.join(proc_dir, pid, "maps"), encoding="utf-8",
                      errors="replace") as f:
                lines = f.readlines()
        except OSError:
            continue  # gone, or not ours to read (and then it cannot map our 0600 files)
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[4] == "0":
                continue  # anonymous memory
            dev = _parse_dev(fields[3])
            if dev is not None and fields[4].isdigit():
                seen.add((dev, int(fields[4])))
    return seen


def scan(
    shm_dir: str = SHM_DIR,
    grace: float = GRACE,
    now: float | None = None,
    proc_dir: str = PROC_DIR,
    uid: int | None = None,
) -> list[Orphan]:
    """The orphans (see the module docstring), sorted by name."""
    uid = os.geteuid() if uid is None else uid
    now = time.time() if now is None else now
    old = {key: o for key, o in _ours(shm_dir, uid).items() if now - o.mtime > grace}
    if not old:
        return []  # the common case: no need to read every process's maps
    mapped = mapped_files(proc_dir)
    return sorted((o for key, o in old.items() if key not in mapped), key=lambda o: o.name)


def remove(orphans: Iterable[Orphan], shm_dir: str = SHM_DIR) -> list[Orphan]:
    """Unlink the given segments; returns those this call removed."""
    removed = []
    for o in orphans:
        try:
            os.unlink(os.path.join(shm_dir, o.name))
        except FileNotFoundError:
            continue  # another sweep got it first
        except OSError:
            continue
        removed.append(o)
    return removed


def find_orphans(
    shm_dir: str = SHM_DIR,
    grace: float = GRACE,
    now: float | None = None,
    proc_dir: str = PROC_DIR,
    uid: int | None = None,
) -> list[str]:
    """Names of the orphaned segments under ``shm_dir``."""
    return [o.name for o in scan(shm_dir, grace, now, proc_dir, uid)]


def remove_orphans(
    shm_dir: str = SHM_DIR,
    grace: float = GRACE,
    now: float | None = None,
    proc_dir: str = PROC_DIR,
    uid: int | None = None,
) -> list[str]:
    """Remove the orphaned segments; returns the names removed."""
    return [o.name for o in remove(scan(shm_dir, grace, now, proc_dir, uid), shm_dir)]
