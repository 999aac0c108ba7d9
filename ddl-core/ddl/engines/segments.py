"""Job-scoped shared-memory segments: naming, creation, mapping and cleanup.

Names are ``ddl-<job id>-h<host index>-<what>`` under /dev/shm. The host index comes from
the launcher's host assignment, never from the hostname: network namespaces on one machine
share /dev/shm, so two "hosts" of a test job must not collide.

Segments are created with O_EXCL and mode 0600 through ``os.open`` rather than
``multiprocessing.shared_memory``: on Python 3.11 an unrelated process's resource tracker
may unlink a SharedMemory it has seen. Names are predictable, so anybody could plant a file
under one first: a segment is opened only when it is a regular file (not a link) owned by
our uid with mode 0600, and every header carries the job's token (engines/shm.py).
``cleanup_job`` is what the launcher (or a person) calls after a crash.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat

from ..errors import DDLConfigError, DDLShmError
from .orphans import JOB_ID

SHM_DIR = "/dev/shm"


def validate_job_id(job_id: str) -> str:
    if not JOB_ID.match(job_id):
        raise DDLConfigError(
            f"job id {job_id!r} is invalid: use 1-64 characters from [A-Za-z0-9_.]"
        )
    return job_id


def segment_name(job_id: str, host_index: int, what: str) -> str:
    validate_job_id(job_id)
    if host_index < 0:
        raise DDLConfigError(f"host index must be >= 0, got {host_index}")
    return f"ddl-{job_id}-h{host_index}-{what}"


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


def _owner(st: os.stat_result) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(st.st_uid).pw_name} (uid {st.st_uid})"
    except (ImportError, KeyError):
        return f"uid {st.st_uid}"


def _exists(path: str) -> SegmentExists:
    try:
        st = os.lstat(path)
        who = f"owner {_owner(st)}, mode {stat.filemode(st.st_mode)}"
    except OSError:
        who = "gone again"
    return SegmentExists(
        f"shared memory {path} already exists ({who}): another job uses this job id, or a "
        "crashed job left it (ddlrun --cleanup removes what no process uses)"
    )


def create(name: str, size: int) -> mmap.mmap:
    """Create a new segment of ``size`` bytes, reserved up front so a small /dev/shm fails
    here with a clear message instead of SIGBUS on first touch. ``SegmentExists`` if the
    name is taken."""
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise _exists(path) from None
    except OSError as exc:
        raise DDLShmError(f"cannot create shared memory {path}: {exc}") from exc
    try:
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


def check_owned(path: str, st: os.stat_result) -> None:
    """Refuse a segment that is not a regular file of ours with mode 0600: a file planted
    under a predictable name by another user must never be joined."""
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to {_owner(st)}, not to this job's user (uid {os.geteuid()})"
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
    validate_job_id(job_id)
    prefix = f"ddl-{job_id}-h" if host_index is None else f"ddl-{job_id}-h{host_index}-"
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if not n.startswith(prefix):
            continue
        if host_index is None:
            # "ddl-<job>-h<digits>-..." only: job "a" must not match job "a.b"'s segments.
            rest = n[len(prefix):]
            digits = rest.split("-", 1)[0]
            if not digits.isdigit():
                continue
        out.append(n)
    return sorted(out)


def cleanup_job(job_id: str, host_index: int | None = None) -> list[str]:
    """Remove every segment of a job (on one host index, or all). Safe to call twice and
    while ranks still run: mapped segments stay valid until unmapped."""
    removed = []
    for n in list_job(job_id, host_index):
        if unlink(n):
            removed.append(n)
    return removed


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m ddl.engines.segments",
        description="Remove the shared-memory segments of a PowerDDL job.",
    )
    p.add_argument("job_id")
    p.add_argument("--host-index", type=int, default=None)
    args = p.parse_args(argv)
    for n in cleanup_job(args.job_id, args.host_index):
        print(f"removed {SHM_DIR}/{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
