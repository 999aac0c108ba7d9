"""Shared memory left behind: ``ddl.engines.orphans`` over a tmp dir and a fake /proc, the
launcher's fallback, ``ddlrun --cleanup``, what a job's cleanup removes (only what is
provably the job's: planted files are left alone and reported) and ddlrun's janitor (``kill
-9`` of ddlrun frees the job's segments at once). (The whole tree killed: test_reliability.)

The janitor's figures for docs/reliability.md, by hand (10 trials, 4 ranks, 256 MiB heaps)::

    .venv/bin/python tests/launcher/test_shm_cleanup.py 10
"""

from __future__ import annotations

import os
import pwd
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddlrun_testlib import (  # noqa: E402
    HERE,
    PY,
    ddlrun_argv,
    janitor_of,
    pid_alive,
    run_ddlrun,
    shm_left,
)

from ddlrun import shm  # noqa: E402

orphans = shm.orphans_module()
pytestmark = pytest.mark.skipif(orphans is None, reason="ddl is not installed")
SHM = Path("/dev/shm")
FAULTS = str(HERE / "scripts" / "faults.py")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def make(dirpath, name, age, size=4096, token=None, mode=0o600, uid=None):
    """A file like a segment; ``token``: the job's mark at ``TOKEN_OFFSET`` (None: zeros)."""
    path = dirpath / name
    data = bytearray(size)
    if token is not None:
        at = orphans.TOKEN_OFFSET
        data[at : at + 8] = orphans.token_bytes(token)
    path.write_bytes(bytes(data))
    if uid is not None:
        os.chown(path, uid, uid)
    os.chmod(path, mode)
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
    keyed = "ddl-jobB-h1-heap1-0-k0123456789abcdef"  # a job with a secret: a keyed name
    make(shm_dir, keyed, age=60)
    make(shm_dir, "ddl-jobE-h0-heap0-0", age=60, mode=0o644)  # not a mode ddl makes
    make(shm_dir, "ddl-jobC-h0-ctl", age=1)  # just created, not mapped yet: not yet
    make(shm_dir, "not-ddl-h0-x", age=60)  # not our naming
    make(shm_dir, "ddl-nohost", age=60)
    os.symlink(live, shm_dir / "ddl-jobD-h0-link")  # not a regular file
    proc = fake_proc(tmp_path / "proc", {123: [live]})
    kw = dict(shm_dir=str(shm_dir), proc_dir=str(proc))
    assert orphans.find_orphans(**kw) == ["ddl-jobB-h0-heap0-0", keyed]
    assert orphans.find_orphans(grace=0.0, **kw) == ["ddl-jobB-h0-heap0-0", keyed,
                                                     "ddl-jobC-h0-ctl"]
    later = time.time() + 30
    assert "ddl-jobC-h0-ctl" in orphans.find_orphans(now=later, **kw)
    assert orphans.find_orphans(uid=os.geteuid() + 1, **kw) == []  # another user's: never
    (scanned,) = [o for o in orphans.scan(**kw) if o.host_index == 1]
    assert (scanned.job_id, scanned.size) == ("jobB", 4096)
    assert orphans.remove_orphans(**kw) == ["ddl-jobB-h0-heap0-0", keyed]
    assert sorted(os.listdir(shm_dir)) == ["ddl-jobA-h0-heap0-0", "ddl-jobC-h0-ctl",
                                           "ddl-jobD-h0-link", "ddl-jobE-h0-heap0-0",
                                           "ddl-nohost", "not-ddl-h0-x"]
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


def _no_secret() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DDL_JOB_SECRET")}


def test_cleanup_of_one_job_and_of_orphans(marker):
    job = f"cl_{marker[-8:]}"
    token = orphans.segment_token(job, None)  # a job without a secret: plain names
    for name in (f"ddl-{job}-h0-heap0-0", f"ddl-{job}-h1-ctl"):
        make(SHM, name, age=0, token=token)
    res = run_ddlrun("--cleanup", "--job-id", job, env=_no_secret())
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"removed /dev/shm/ddl-{job}-h0-heap0-0",
                                               f"removed /dev/shm/ddl-{job}-h1-ctl"]
    assert shm_left(job) == []
    make(SHM, f"ddl-{job}-h0-heap0-0", age=60, size=2**20)
    res = run_ddlrun("--cleanup")
    assert res.returncode == 0, res.stderr
    assert f"removed /dev/shm/ddl-{job}-h0-heap0-0 (1.0 MiB)" in res.stdout
    assert "ddlrun: removed" in res.stderr and shm_left(job) == []
    assert run_ddlrun("--cleanup", "--job-id", "bad/id").returncode == 2


# ---------------------------------------------------------------------------- one job's
def _left_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "shared-memory names alone" in ln]


def test_a_jobs_cleanup_removes_only_what_is_provably_its(marker):
    """The job's own segment goes; under its names a wrong token, a loose mode, another
    job's key, a plain name of a job that has a secret, and (as root) a file of ``nobody``
    stay, reported in one line with why."""
    job, secret = f"pv_{marker[-8:]}", marker.encode()
    token = orphans.segment_token(job, secret)

    def name(what: str, key: bytes | None = secret) -> str:
        return orphans.segment_name(job, 0, what, key)

    ours = name("heap0-0")
    planted = {name("heap1-0"): ("does not carry the job's token", dict(token=token + 1)),
               name("heap2-0"): ("has mode -rw-r--r--", dict(token=token, mode=0o644)),
               name("heap3-0", b"other"): ("is not named with the job's key",
                                          dict(token=token)),
               name("ctl", None): ("is not named with the job's key", dict(token=token))}
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody").pw_uid
        planted[name("heap4-0")] = (f"belongs to nobody (uid {nobody})",
                                    dict(token=token, uid=nobody))
    make(SHM, ours, age=0, token=token)
    owners = {n: os.stat(make(SHM, n, age=0, **kw)).st_uid for n, (_, kw) in planted.items()}
    try:
        res = run_ddlrun("--cleanup", "--job-id", job,
                         env={**_no_secret(), "DDL_JOB_SECRET": secret.decode()})
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == [f"removed /dev/shm/{ours}"]
        (line,) = _left_lines(res.stderr)
        assert line.startswith(f"ddlrun: left {len(planted)} file(s) under job {job}'s "), line
        for n, (why, _) in planted.items():
            assert f"/dev/shm/{n} {why}" in line, (n, line)
        assert {n: (SHM / n).stat().st_uid for n in planted} == owners  # untouched
        # without the secret nothing keyed can be checked: the same files, and the keyed
        # names said to need it
        make(SHM, ours, age=0, token=token)
        res = run_ddlrun("--cleanup", "--job-id", job, env=_no_secret())
        assert res.returncode == 0 and res.stdout == "", res.stdout
        (line,) = _left_lines(res.stderr)
        assert f"/dev/shm/{ours} has a keyed name, which only the job's secret" in line, line
        # the library's entry point keeps to the same rules
        from ddl.engines import segments

        assert segments.cleanup_job(job, None, secret) == [ours]
        assert sorted(shm_left(job)) == sorted(planted)
    finally:
        for n in [ours, *planted]:
            (SHM / n).unlink(missing_ok=True)


MALLOC_JOB = ("import numpy as np, ddl; ddl.init(); a = ddl.malloc((8,), np.float32); "
              "a[:] = 1; ddl.allreduce_(a, op=ddl.Sum); print('sum', a[0], flush=True); "
              "ddl.shutdown()")


def test_a_squatted_name_neither_stops_a_job_with_a_secret_nor_is_removed(marker):
    """ddlrun gives every job a secret, so its segment names cannot be computed in advance:
    files planted under the names the job would have had without one (as ``nobody`` when
    root, and of this uid with no token) neither stop it nor are removed by its cleanup,
    which names them in one line."""
    job = f"sq_{marker[-8:]}"
    planted = {orphans.segment_name(job, 0, "heap0-0", None): os.geteuid()}
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody").pw_uid
        planted[orphans.segment_name(job, 0, "ctl", None)] = nobody
        planted[orphans.segment_name(job, 0, "heap1-0", None)] = nobody
    for n, uid in planted.items():
        make(SHM, n, age=0, mode=0o600 if uid == os.geteuid() else 0o666, uid=uid)
    try:
        res = run_ddlrun("-n", "2", "--job-id", job, PY, "-c", MALLOC_JOB, env=_no_secret())
        assert res.returncode == 0, res.stderr
        assert res.stdout.count("sum 2.0") == 2, res.stdout
        assert {n: (SHM / n).stat().st_uid for n in planted} == planted
        assert sorted(shm_left(job)) == sorted(planted)  # the job's own are gone
        (line,) = _left_lines(res.stderr)
        assert all(f"/dev/shm/{n} " in line for n in planted), line
    finally:
        for n in planted:
            (SHM / n).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- the janitor
def test_the_janitor_removes_the_jobs_segments_only_when_ddlrun_dies(marker):
    job, secret = f"jn_{marker[-8:]}", marker.encode()
    token = orphans.segment_token(job, secret)
    seg = orphans.segment_name(job, 0, "heap0-0", secret)
    make(SHM, seg, age=0, token=token)
    try:
        janitor = shm.Janitor.start(job, [0], secret)
        assert janitor is not None
        t0 = time.monotonic()
        janitor.finish()  # ddlrun ended the job itself
        assert time.monotonic() - t0 < 2.0 and shm_left(job) == [seg]
        janitor = shm.Janitor.start(job, [0], secret)
        time.sleep(0.3)  # started and waiting
        janitor._proc.stdin.close()  # what ddlrun's death does to the pipe
        t0 = time.monotonic()
        while shm_left(job) and time.monotonic() - t0 < 5:
            time.sleep(0.005)
        freed = time.monotonic() - t0
        janitor._proc.wait(timeout=5)
        assert shm_left(job) == [] and freed < 1.0, freed
    finally:
        (SHM / seg).unlink(missing_ok=True)




def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[19]


@dataclass
class KillTrial:
    segments: int  # the job's segments when ddlrun was killed
    mib: float  # their size
    freed: float | None  # seconds from the kill until none was left (None: not within 10 s)
    ranks_gone: float | None  # seconds until no rank was left: their mappings with them
    gone: float | None  # seconds until no rank and no janitor was left (None: not within 10 s)
    stderr: str

    def problems(self, nranks: int, limit: float = 2.0) -> list[str]:
        bad = []
        if self.segments != nranks:
            bad.append(f"{self.segments} segments before the kill, expected {nranks}")
        if self.freed is None or self.freed > limit:
            bad.append(f"segments freed after {self.freed} s (limit {limit} s)")
        if self.gone is None:
            bad.append("a rank or the janitor outlived ddlrun by 10 s")
        if f"its janitor removed {nranks} shared-memory segment(s)" not in self.stderr:
            bad.append(f"no janitor line: {self.stderr[-500:]!r}")
        return bad


def kill_trial(job: str, nranks: int = 4, heap_bytes: int | None = None) -> KillTrial:
    """``ddlrun -n NRANKS`` whose ranks ``ddl.malloc`` and wait, then ``kill -9`` of ddlrun
    alone (not its group): how soon the job's segments are gone, and its processes."""
    env = _no_secret()
    if heap_bytes:
        env["DDL_SHM_HEAP_BYTES"] = str(heap_bytes)
    proc = subprocess.Popen(ddlrun_argv("-n", str(nranks), "--job-id", job, PY, FAULTS,
                                        "malloc"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put(None)],
                     daemon=True).start()
    out, deadline = "", time.monotonic() + 60
    try:
        while out.count(" ready\n") < nranks:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{nranks} ranks not ready within 60 s: {out!r}") from None
            if line is None:
                proc.wait(timeout=10)
                raise AssertionError(f"the job ended before its ranks were ready (exit "
                                     f"{proc.returncode}): {proc.stderr.read()[-2000:]}")
            out += line
        janitor = janitor_of(proc.pid)
        assert janitor is not None, "ddlrun started no janitor"
        procs = [(int(m.group(1)), m.group(2))
                 for m in re.finditer(r"^\[\d+\] pid (\d+) (\d+)$", out, re.M)]
        ranks = list(procs)
        procs.append((janitor, _start_time(janitor)))
        live = shm_left(job)
        size = sum(os.stat(SHM / n).st_size for n in live)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    freed = ranks_gone = gone = None
    while time.monotonic() - t0 < 10 and (freed is None or gone is None):
        now = time.monotonic() - t0
        if freed is None and not any((SHM / n).exists() for n in live):
            freed = now
        if ranks_gone is None and not any(pid_alive(*p) for p in ranks):
            ranks_gone = now
        if gone is None and not any(pid_alive(*p) for p in procs):
            gone = now
        time.sleep(0.005)
    proc.wait(timeout=10)
    for pid, start in procs:  # never leave them behind, even when the trial fails
        if pid_alive(pid, start):
            os.kill(pid, signal.SIGKILL)
    return KillTrial(len(live), size / 2**20, freed, ranks_gone, gone, proc.stderr.read())


def test_kill_9_of_ddlrun_frees_the_jobs_shared_memory_at_once(marker):
    """Its ranks die with it (PR_SET_PDEATHSIG) before they can unlink their heaps; its
    janitor removes them, and exits. Three trials, 16 MiB heaps (the figures: ``main``)."""
    for i in range(3):
        trial = kill_trial(f"k9_{i}_{marker[-8:]}", 4, 16 << 20)
        assert trial.problems(4) == [], trial


def main(argv: list[str]) -> int:
    """Trials of ``kill_trial`` (default 10, 4 ranks, the default 256 MiB heaps)."""
    n = int(argv[0]) if argv else 10
    trials = []
    for i in range(n):
        trial = kill_trial(f"k9m_{os.getpid()}_{i}", 4)
        trials.append(trial)
        bad = trial.problems(4)
        print(f"{i + 1:3d} {trial.segments} segments, {trial.mib:.1f} MiB: names gone after "
              f"{_secs(trial.freed)}, ranks after {_secs(trial.ranks_gone)}, the janitor "
              f"after {_secs(trial.gone)}" + (f"  PROBLEMS: {'; '.join(bad)}" if bad else ""),
              flush=True)
    good = sum(not t.problems(4) for t in trials)
    print(f"\n{n} trials: {good} without a problem; worst: names gone after "
          f"{_worst(t.freed for t in trials)}, ranks after "
          f"{_worst(t.ranks_gone for t in trials)}, every process after "
          f"{_worst(t.gone for t in trials)}")
    return 0 if good == n else 1


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.3f} s"


def _worst(values) -> str:
    values = list(values)
    return "never" if None in values else _secs(max(values))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
