"""Orphaned shared memory: ``ddl.engines.orphans`` over a tmp dir and a fake /proc, the
launcher's fallback, and ``ddlrun --cleanup``. (Real killed jobs: test_reliability.py.)"""

import os
import time

import pytest
from ddlrun_testlib import run_ddlrun, shm_left

from ddlrun import shm

orphans = shm.orphans_module()
pytestmark = pytest.mark.skipif(orphans is None, reason="ddl is not installed")


def make(dirpath, name, age, size=4096):
    path = dirpath / name
    path.write_bytes(b"\0" * size)
    os.chmod(path, 0o600)
    t = time.time() - age
    os.utime(path, (t, t))
    return path


def fake_proc(root, maps_by_pid):
    """A /proc with ``PID/maps`` files mapping the given paths (by device and inode)."""
    for pid, paths in maps_by_pid.items():
        (root / str(pid)).mkdir(parents=True)
        lines = ["7f0000000000-7f0000001000 r-xp 00000000 00:00 0 [vdso]"]
        for p in paths:
            st = os.stat(p)
            dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
            lines.append(f"7f0000001000-7f0000002000 rw-s 00000000 {dev} {st.st_ino} "
                         f"{p} (deleted)")
        (root / str(pid) / "maps").write_text("\n".join(lines) + "\n")
    (root / "self").mkdir(exist_ok=True)  # not a pid: ignored
    return root


def test_only_unmapped_old_segments_of_ours_are_orphans(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    live = make(shm_dir, "ddl-jobA-h0-heap0-0", age=60)
    make(shm_dir, "ddl-jobB-h0-heap0-0", age=60)  # nobody maps it: orphan
    make(shm_dir, "ddl-jobB-h1-heap1-0", age=60)
    make(shm_dir, "ddl-jobC-h0-ctl", age=1)  # just created, not mapped yet: not yet
    make(shm_dir, "not-ddl-h0-x", age=60)  # not our naming
    make(shm_dir, "ddl-nohost", age=60)
    os.symlink(live, shm_dir / "ddl-jobD-h0-link")  # not a regular file
    proc = fake_proc(tmp_path / "proc", {123: [live]})
    kw = dict(shm_dir=str(shm_dir), proc_dir=str(proc))
    assert orphans.find_orphans(**kw) == ["ddl-jobB-h0-heap0-0", "ddl-jobB-h1-heap1-0"]
    assert orphans.find_orphans(grace=0.0, **kw) == ["ddl-jobB-h0-heap0-0",
                                                     "ddl-jobB-h1-heap1-0", "ddl-jobC-h0-ctl"]
    later = time.time() + 30
    assert "ddl-jobC-h0-ctl" in orphans.find_orphans(now=later, **kw)
    assert orphans.find_orphans(uid=os.geteuid() + 1, **kw) == []  # another user's: never
    (scanned,) = [o for o in orphans.scan(**kw) if o.host_index == 1]
    assert (scanned.job_id, scanned.size) == ("jobB", 4096)
    assert orphans.remove_orphans(**kw) == ["ddl-jobB-h0-heap0-0", "ddl-jobB-h1-heap1-0"]
    assert sorted(os.listdir(shm_dir)) == ["ddl-jobA-h0-heap0-0", "ddl-jobC-h0-ctl",
                                           "ddl-jobD-h0-link", "ddl-nohost", "not-ddl-h0-x"]
    assert orphans.remove_orphans(**kw) == []  # twice is fine


def test_a_segment_mapped_by_this_very_process_is_not_an_orphan(tmp_path):
    import mmap

    seg = make(tmp_path, "ddl-jobM-h0-heap0-0", age=60)
    with open(seg, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert orphans.find_orphans(shm_dir=str(tmp_path)) == []  # the real /proc
    assert orphans.find_orphans(shm_dir=str(tmp_path)) == ["ddl-jobM-h0-heap0-0"]


def test_no_candidates_means_no_proc_scan(tmp_path, monkeypatch):
    monkeypatch.setattr(orphans, "mapped_files", lambda proc_dir: pytest.fail("scanned"))
    make(tmp_path, "ddl-jobN-h0-ctl", age=0)
    assert orphans.find_orphans(shm_dir=str(tmp_path)) == []


def test_launcher_loads_the_scan_without_the_rest_of_ddl(monkeypatch):
    # a host where `import ddl` fails (numpy missing, a broken install)
    import builtins

    real = builtins.__import__

    def no_ddl(name, *args, **kw):
        if name == "ddl" or name.startswith("ddl."):
            raise ImportError(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ddl)
    module = shm.orphans_module()
    assert module is not None and module.__name__ == "_ddlrun_orphans"
    assert callable(module.scan) and callable(module.remove)


def test_cleanup_of_one_job_and_of_orphans(marker):
    job = f"cl_{marker[-8:]}"
    for name in (f"ddl-{job}-h0-heap0-0", f"ddl-{job}-h1-ctl"):
        make(__import__("pathlib").Path("/dev/shm"), name, age=0)
    res = run_ddlrun("--cleanup", "--job-id", job)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"removed /dev/shm/ddl-{job}-h0-heap0-0",
                                               f"removed /dev/shm/ddl-{job}-h1-ctl"]
    assert shm_left(job) == []
    make(__import__("pathlib").Path("/dev/shm"), f"ddl-{job}-h0-heap0-0", age=60,
         size=2**20)
    res = run_ddlrun("--cleanup")
    assert res.returncode == 0, res.stderr
    assert f"removed /dev/shm/ddl-{job}-h0-heap0-0 (1.0 MiB)" in res.stdout
    assert "ddlrun: removed" in res.stderr and shm_left(job) == []
    assert run_ddlrun("--cleanup", "--job-id", "bad/id").returncode == 2
