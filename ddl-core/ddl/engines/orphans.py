"""Which files in /dev/shm are a job's segments, and which no process uses any more.

This file is the one copy of the rules that decide what ddl may remove (``segments.py``,
ddlrun's cleanup and its janitor use it), standard library only: ddlrun loads it by path on
hosts where the rest of ddl may not import.

**Names.** ``ddl-<job id>-h<host index>-<what>``, plus ``-k<key>`` when the job has a secret:
the key is 64 bits of HMAC-SHA256 under the secret over the job id, host index and ``what``.
The job id is no secret (other users see it in /dev/shm as soon as the job has a segment),
but no other user can compute the name of a segment before it exists, so none can squat it.
Without a secret (ranks started by hand) the names are predictable, as they always were; a
squatted name then makes the job fail, never join (``segments.check_owned``).

**Ours.** A file is a segment of job J (``remove_job``) when it is a regular file of our uid
with mode 0600 that carries J's token in its header (bytes ``TOKEN_OFFSET`` to +8, written
right after the file is made) and, where J has a secret, whose name carries J's key.
Anything else under J's names (a file another user planted, a loose mode, a wrong token or
key) is left alone and reported. Without the secret a keyed name cannot be checked, so it is
left too: the orphan sweep removes it once no process maps it.

**Orphans**, what a job leaves in /dev/shm when it is killed outright and nothing cleaned up
after it (ddlrun's janitor removes a SIGKILLed ddlrun's segments at once). A segment is an
orphan when it

- is named like ours, is a regular file of our uid with mode 0600,
- is mapped by no process we can see (``/proc/*/maps``, matched by device and inode, so a
  process in another mount namespace counts too), and
- was last modified more than ``grace`` seconds ago: between ``create`` and ``mmap`` a live
  job's segment is mapped by nobody yet.

Every live job maps each of its segments at least in the process that created it, for the
segment's whole life, so a live job's segments are never orphans. Only processes in our PID
namespace are visible: on hosts where containers of another PID namespace share this
/dev/shm (``--ipc=host``), run the sweep inside the container that runs the jobs.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
PROC_DIR = "/proc"
GRACE = 10.0  # seconds

# The job-id rule, the one copy: ``segments.validate_job_id`` (the core) and ddlrun (through
# ``ddlrun.shm.job_id_rule``, which loads this file even where ``import ddl`` fails) use it.
JOB_ID_CHARS = "[A-Za-z0-9_.]{1,64}"
JOB_ID = re.compile(JOB_ID_CHARS)  # use with fullmatch: "$" would take a trailing newline
_NAME = re.compile(rf"ddl-({JOB_ID_CHARS})-h([0-9]+)-.+")
KEY_CHARS = 16  # hex digits of a name's key: 64 bits
# ddl-<job>-h<index>-<what>[-k<key>]: ``what`` never ends in "-k" and 16 hex digits
_PARTS = re.compile(rf"ddl-({JOB_ID_CHARS})-h([0-9]+)-(.+?)(?:-k([0-9a-f]{{{KEY_CHARS}}}))?")
TOKEN_OFFSET = 48  # bytes into every segment: the job's token (8 bytes, native order)


def name_key(secret: bytes, job_id: str, host_index: int, what: str) -> str:
    """The keyed part of a segment's name (``KEY_CHARS`` hex digits)."""
    msg = f"ddl-segment-name:{job_id}:{host_index}:{what}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()[:KEY_CHARS]


def segment_name(job_id: str, host_index: int, what: str, secret: bytes | None) -> str:
    """The one rule for a segment's name (unchecked: ``segments.segment_name`` validates)."""
    plain = f"ddl-{job_id}-h{host_index}-{what}"
    return f"{plain}-k{name_key(secret, job_id, host_index, what)}" if secret else plain


def segment_token(job_id: str, secret: bytes | None) -> int:
    """The 63-bit mark every segment of the job carries at ``TOKEN_OFFSET``: derived from the
    secret (so a job id alone does not forge it) or, without one, from the id. Not the name's
    key: names are public, tokens only readable by our uid."""
    key = secret if secret else b"ddl-no-secret"
    mac = hmac.new(key, f"ddl-segment:{job_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(mac[:8], "little") & ((1 << 63) - 1) or 1


def token_bytes(token: int) -> bytes:
    return token.to_bytes(8, sys.byteorder, signed=True)


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
        m = _NAME.fullmatch(name)
        if not m:
            continue
        try:
            st = os.lstat(os.path.join(shm_dir, name))
        except OSError:
            continue  # removed meanwhile
        if _problem(st, uid):
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


# ---------------------------------------------------------------------------- one job
def owner(st: os.stat_result) -> str:
    """``name (uid N)`` of a file's owner, or ``uid N``."""
    try:
        import pwd

        return f"{pwd.getpwuid(st.st_uid).pw_name} (uid {st.st_uid})"
    except (ImportError, KeyError):
        return f"uid {st.st_uid}"


def _problem(st: os.stat_result, uid: int) -> str | None:
    """Why a file cannot be one of our segments by its type, owner and mode (None: it can)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != uid:
        return f"belongs to {owner(st)}"
    if stat.S_IMODE(st.st_mode) != 0o600:
        return f"has mode {stat.filemode(st.st_mode)}, not -rw-------"
    return None


def job_names(job_id: str, host_index: int | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    """The names under ``shm_dir`` that job ``job_id`` would use (on one host index, or all),
    sorted; whose files they are is not looked at."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    found = []
    for name in names:
        m = _PARTS.fullmatch(name)
        if m and m.group(1) == job_id and host_index in (None, int(m.group(2))):
            found.append(name)
    return sorted(found)


@dataclass(frozen=True)
class JobCleanup:
    """What ``remove_job`` did: the names it removed, and those it left alone with why."""

    job_id: str
    removed: tuple[str, ...] = ()
    left: tuple[tuple[str, str], ...] = ()  # (name, why it is not the job's to remove)
    freed: int = 0  # bytes of the removed segments

    def left_line(self, shm_dir: str = SHM_DIR) -> str | None:
        """The one line that reports what was left alone (None when nothing was)."""
        if not self.left:
            return None
        each = "; ".join(f"{os.path.join(shm_dir, n)} {why}" for n, why in self.left)
        return (f"left {len(self.left)} file(s) under job {self.job_id}'s shared-memory names "
                f"alone, as they are not provably the job's: {each}")


def _why_not(path: str, name: str, job_id: str, secret: bytes | None, token: int, uid: int
             ) -> str | None:
    """Why the file ``path`` is not a segment of the job to remove (None: it is).
    FileNotFoundError when it is gone. Opened without following links or blocking (a
    planted FIFO)."""
    problem = _problem(os.lstat(path), uid)
    if problem:
        return problem
    m = _PARTS.fullmatch(name)
    host, what, key = int(m.group(2)), m.group(3), m.group(4)
    if key and not secret:
        return ("has a keyed name, which only the job's secret (DDL_JOB_SECRET) can check "
                "(ddlrun --cleanup removes it once no process maps it)")
    if secret and key != name_key(secret, job_id, host, what):
        return "is not named with the job's key"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        return f"cannot be read ({exc.strerror})"
    try:
        problem = _problem(os.fstat(fd), uid)  # the file opened is the file checked
        if problem:
            return problem
        if os.pread(fd, 8, TOKEN_OFFSET) != token_bytes(token):
            return "does not carry the job's token"
    finally:
        os.close(fd)
    return None


def remove_job(job_id: str, host_index: int | None = None, secret: bytes | None = None,
               shm_dir: str = SHM_DIR, uid: int | None = None) -> JobCleanup:
    """Remove job ``job_id``'s segments (see the module docstring for which are its), given
    the job's ``secret`` if it has one. A segment that is ours cannot be swapped for another
    user's file between the check and the unlink: /dev/shm is sticky, only its owner (or
    root) can rename or remove it. Removing a name never disturbs a process that maps it."""
    uid = os.geteuid() if uid is None else uid
    token = segment_token(job_id, secret)
    removed: dict[str, int] = {}  # name: bytes
    left: list[tuple[str, str]] = []
    for name in job_names(job_id, host_index, shm_dir):
        path = os.path.join(shm_dir, name)
        try:
            why = _why_not(path, name, job_id, secret, token, uid)
            size = os.lstat(path).st_size
        except FileNotFoundError:
            continue  # removed meanwhile
        if why:
            left.append((name, why))
        elif _unlink(path):
            removed[name] = size
    return JobCleanup(job_id, tuple(sorted(removed)), tuple(sorted(left)),
                      sum(removed.values()))


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:  # gone meanwhile (another cleanup), or not ours to remove after all
        return False
