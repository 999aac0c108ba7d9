"""Job-scoped shared-memory segments: naming, creation, mapping and cleanup.

Names are ``ddl-<job id>-h<host index>-<what>``, followed by ``-k<key>`` when the job has a
secret (a key other users cannot compute: ``orphans.segment_name``, the one rule). The host
index comes from the launcher's host assignment, never from the hostname: network
namespaces on one machine share /dev/shm, so two "hosts" of a test job must not collide.

Segments are created with O_EXCL and mode 0600 through ``os.open`` rather than
``multiprocessing.shared_memory``: on Python 3.11 an unrelated process's resource tracker
may unlink a SharedMemory it has seen. Without a secret names are predictable, so anybody
could plant a file under one first: a segment is opened only when it is a regular file (not
a link) owned by our uid with mode 0600, and every segment carries the job's token at
``TOKEN_OFFSET`` from the moment it is made. ``cleanup_job`` is what the launcher (or a
person) calls after a crash: it removes only what is provably the job's (``orphans.py``).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import sys

from ..errors import DDLConfigError, DDLShmError
from . import orphans
from .orphans import JOB_ID, TOKEN_OFFSET, JobCleanup
from .orphans import segment_token as segment_token  # the job's mark, for its users here

SHM_DIR = "/dev/shm"
_log = logging.getLogger("ddl")


def validate_job_id(job_id: str) -> str:
    if not JOB_ID.fullmatch(job_id):
        raise DDLConfigError(
            f"job id {job_id!r} is invalid: use 1-64 characters from [A-Za-z0-9_.]"
        )
    return job_id


def segment_name(job_id: str, host_index: int, what: str, secret: bytes | None = None) -> str:
    """The name of one of the job's segments; keyed when the job has a secret."""
    validate_job_id(job_id)
    if host_index < 0:
        raise DDLConfigError(f"host index must be >= 0, got {host_index}")
    return orphans.segment_name(job_id, host_index, what, secret)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def space() -> tuple[int, int]:
    """(total, free) bytes of the shared-memory file system."""
    st = os.statvfs(SHM_DIR)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _too_small(name: str, size: int) -> DDLShmError:
    total, free = space()
    return DDLShmError(
        f"cannot reserve {size / 2**20:.1f} MiB in {SHM_DIR} for {name} "
        f"({free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB). "
        "In a container, start it with a larger /dev/shm (docker run --shm-size=1g, or "
        "--ipc=host), or lower DDL_SHM_MAX_BYTES / DDL_SHM_HEAP_BYTES."
    )


class SegmentExists(DDLShmError, FileExistsError):
    """A segment of that name is already there (a running job, a crashed one, or a file
    somebody planted)."""


def _exists(path: str) -> SegmentExists:
    try:
        st = os.lstat(path)
        who = f"owner {orphans.owner(st)}, mode {stat.filemode(st.st_mode)}"
    except OSError:
        who = "gone again"
    return SegmentExists(
        f"shared memory {path} already exists ({who}): another job uses this job id, or a "
        "crashed job left it (ddlrun --cleanup removes what no process uses)"
    )


def create(name: str, size: int, token: int) -> mmap.mmap:
    """Create a new segment of ``size`` bytes (at least ``TOKEN_OFFSET + 8``) that carries
    the job's ``token`` (``segment_token``) from its first moment, so that a cleanup can tell
    it is the job's even when its maker dies while it reserves the rest. The space is
    reserved up front so a small /dev/shm fails here with a clear message instead of SIGBUS
    on first touch. ``SegmentExists`` if the name is taken."""
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise _exists(path) from None
    except OSError as exc:
        raise DDLShmError(f"cannot create shared memory {path}: {exc}") from exc
    try:
        os.pwrite(fd, orphans.token_bytes(token), TOKEN_OFFSET)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise _too_small(name, size) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def carries(mm: mmap.mmap, token: int) -> bool:
    """Whether the mapped segment ``mm`` carries the job's ``token``."""
    return mm[TOKEN_OFFSET : TOKEN_OFFSET + 8] == orphans.token_bytes(token)


def check_owned(path: str, st: os.stat_result) -> None:
    """Refuse a segment that is not a regular file of ours with mode 0600: a file planted
    under a predictable name by another user must never be joined."""
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to {orphans.owner(st)}, not to this job's user (uid {os.geteuid()})"
    elif stat.S_IMODE(st.st_mode) != 0o600:
        problem = f"has mode {stat.filemode(st.st_mode)}, not -rw-------"
    if problem:
        raise DDLShmError(
            f"refusing shared memory {path}: it {problem}. ddl makes its segments 0600 for "
            "its own user only; somebody else made this one. Remove it (as its owner or "
            "root) and give the job a fresh id"
        )


def open_existing(name: str) -> mmap.mmap:
    """Map a segment another process of this job created; FileNotFoundError if it is not
    there yet, DDLShmError if it is not ours (see ``check_owned``)."""
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DDLShmError(f"refusing shared memory {path}: it is a symbolic link") from None
        if exc.errno == errno.EACCES:
            try:
                check_owned(path, os.lstat(path))
            except FileNotFoundError:
                raise exc from None
        raise
    try:
        st = os.fstat(fd)
        check_owned(path, st)
        size = st.st_size
        if size == 0:
            # Created but not yet sized by its owner: treat as not there yet.
            raise FileNotFoundError(errno.ENOENT, "segment not ready", name)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unlink(name: str) -> bool:
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


def list_job(job_id: str, host_index: int | None = None) -> list[str]:
    """Every name of the job's (on one host index, or all), whoever's files they are."""
    return orphans.job_names(validate_job_id(job_id), host_index, SHM_DIR)


def cleanup_job(job_id: str, host_index: int | None = None, secret: bytes | None = None
                ) -> list[str]:
    """Remove the job's segments (on one host index, or all): only those provably its
    (``orphans.remove_job``: our uid, mode 0600, the job's token, and its key where the job
    has a ``secret``); what else is under its names is left alone and logged in one line.
    The names removed. Safe to call twice and while ranks still run: mapped segments stay
    valid until unmapped."""
    result = sweep_job(job_id, host_index, secret)
    if line := result.left_line(SHM_DIR):
        _log.warning("[ddl] %s", line)
    return list(result.removed)


def sweep_job(job_id: str, host_index: int | None = None, secret: bytes | None = None
              ) -> JobCleanup:
    """``cleanup_job``, with what it left alone and why."""
    return orphans.remove_job(validate_job_id(job_id), host_index, secret, SHM_DIR)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m ddl.engines.segments",
        description="Remove the shared-memory segments of a PowerDDL job (with the job's "
                    "secret from DDL_JOB_SECRET or DDL_JOB_SECRET_FILE, if it had one).",
    )
    p.add_argument("job_id")
    p.add_argument("--host-index", type=int, default=None)
    args = p.parse_args(argv)
    from ..identity import job_secret

    result = sweep_job(args.job_id, args.host_index, job_secret())  # DDL_JOB_SECRET(_FILE)
    for n in result.removed:
        print(f"removed {SHM_DIR}/{n}")
    if line := result.left_line(SHM_DIR):
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
