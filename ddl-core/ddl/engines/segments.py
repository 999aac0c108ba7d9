"""Job-scoped shared-memory segments: naming, creation, mapping and cleanup.

Names are ``ddl-<job id>-h<host index>-<what>`` under /dev/shm. The host index comes from
the launcher's host assignment, never from the hostname: network namespaces on one machine
share /dev/shm, so two "hosts" of a test job must not collide.

Segments are created with O_EXCL and mode 0600 through ``os.open`` rather than
``multiprocessing.shared_memory``: on Python 3.11 an unrelated process's resource tracker
may unlink a SharedMemory it has seen. ``cleanup_job`` is what the launcher (or a person)
calls after a crash.
"""

from __future__ import annotations

import errno
import mmap
import os
import re

from ..errors import DDLConfigError, DDLShmError

SHM_DIR = "/dev/shm"
_JOB_ID = re.compile(r"^[A-Za-z0-9_.]{1,64}$")


def validate_job_id(job_id: str) -> str:
    if not _JOB_ID.match(job_id):
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


def _too_small(name: str, size: int) -> DDLShmError:
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    return DDLShmError(
        f"cannot reserve {size / 2**20:.1f} MiB in {SHM_DIR} for {name} "
        f"({free / 2**20:.1f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.1f} MiB). "
        "In a container, start it with a larger /dev/shm (docker run --shm-size=1g, or "
        "--ipc=host), or lower DDL_SHM_MAX_BYTES / DDL_SHM_HEAP_BYTES."
    )


def create(name: str, size: int) -> mmap.mmap:
    """Create a new segment of ``size`` bytes, reserved up front so a small /dev/shm fails
    here with a clear message instead of SIGBUS on first touch."""
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise
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


def open_existing(name: str) -> mmap.mmap:
    """Map a segment another process created; FileNotFoundError if it is not there yet."""
    fd = os.open(_path(name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
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
