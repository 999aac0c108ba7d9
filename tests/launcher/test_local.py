"""Real local multi-process runs: exit codes, fail-fast, signals, timeouts, logs, output
tagging, shared-memory cleanup, no orphans."""

import os
import re
import signal
import subprocess
import time

import pytest
from ddlrun_testlib import PY, WORKER, ddlrun_argv, run_ddlrun, shm_left, wait_gone


def test_success_and_tagged_lines_never_interleave(marker):
    res = run_ddlrun("-n", "2", PY, WORKER, "spam", marker, "300")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 600
    pat = re.compile(r"^\[(\d)\] (\d):(\d+):x{2000}$")
    for line in lines:
        m = pat.match(line)
        assert m and m.group(1) == m.group(2), line[:80]


def test_untagged_output():
    res = run_ddlrun("-n", "2", "--no-tag-output", PY, "-c", "print('plain')")
    assert res.returncode == 0 and res.stdout.splitlines() == ["plain", "plain"]


def test_failure_exit_code_fail_fast_report_and_no_orphans(marker, tmp_path):
    t0 = time.monotonic()
    res = run_ddlrun("-n", "3", "--log-dir", str(tmp_path), "--job-id", f"ff_{marker[-6:]}",
                     PY, WORKER, "fail", marker, "1", "7")
    took = time.monotonic() - t0
    assert res.returncode == 7, res.stderr
    assert took < 10, f"fail-fast took {took:.1f}s"
    err = res.stderr
    assert "rank 1 on host localhost (pid " in err and "exited with code 7" in err
    assert "| rank 1 about to fail" in err and "| some error detail" in err
    assert "rank.1.out" in err
    logs = tmp_path / f"ff_{marker[-6:]}"
    assert (logs / "rank.1.out").read_text() == "rank 1 about to fail\n"
    assert (logs / "rank.1.err").read_text() == "some error detail\n"
    assert (logs / "rank.0.out").read_text() == "ready\n"
    assert wait_gone(marker) == []


def test_killed_rank_gives_128_plus_signal(marker):
    res = run_ddlrun("-n", "2", PY, WORKER, "fail", marker, "0", str(-signal.SIGKILL))
    assert res.returncode == 137
    assert "rank 0 on host localhost" in res.stderr and "killed by SIGKILL" in res.stderr
    assert wait_gone(marker) == []


def test_grandchildren_are_killed_too(marker):
    res = run_ddlrun("-n", "2", "--grace", "1", PY, WORKER, "grandchild", marker)
    assert res.returncode == 5
    assert wait_gone(marker) == []


def test_timeout_names_running_ranks(marker):
    t0 = time.monotonic()
    res = run_ddlrun("-n", "2", "--timeout", "1.5", PY, WORKER, "sleep", marker)
    assert res.returncode == 124
    assert time.monotonic() - t0 < 10
    assert "--timeout 1.5s reached; ranks still running: 0 (localhost), 1 (localhost)" \
        in res.stderr
    assert wait_gone(marker) == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_everything(marker, sig, code):
    proc = subprocess.Popen(ddlrun_argv("-n", "2", PY, WORKER, "sleep", marker),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = 0
        while ready < 2:
            line = proc.stdout.readline()
            assert line, "ddlrun ended early"
            ready += line.endswith("ready\n")
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=15)
        assert time.monotonic() - t0 < 8
        assert proc.returncode == code, err
        assert "stopping all ranks" in err
        assert wait_gone(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shared_memory_of_the_job_is_removed_after_a_failure(marker):
    job = f"shm_{marker[-8:]}"
    res = run_ddlrun("-n", "2", "--job-id", job, PY, WORKER, "shm", marker, "0")
    assert res.returncode == 3
    assert shm_left(job) == []
    assert wait_gone(marker) == []


def test_missing_program_is_reported():
    res = run_ddlrun("-n", "1", "/nonexistent/prog")
    assert res.returncode == 127, res.stderr  # the shell's "command not found"
    assert "/nonexistent/prog" in res.stderr


def test_ddl_script_runs_under_ddlrun():
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                          "launcher_ddl_allreduce.py")
    res = run_ddlrun("-n", "2", "--timeout", "120", PY, script, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("ok") == 2


# Each rank records its pid and the pid of a child it leaves running, then exits 0.
LEAVE_A_CHILD = """\
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", sys.argv[1]])
with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
"""


def _alive(pid: int, tag: str) -> bool:
    """Whether ``pid`` is still a live (not zombie) process of ours (``tag`` in its argv)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if tag.encode() not in f.read():
                return False  # gone, and the pid reused by someone else
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_no_rank_nor_a_child_it_left_outlives_a_successful_job(tmp_path):
    tag = str(tmp_path)
    res = run_ddlrun("-n", "2", PY, "-c", LEAVE_A_CHILD, tag)
    pids = [int(p) for r in ("0", "1") if (tmp_path / r).exists()
            for p in (tmp_path / r).read_text().split()]
    try:
        assert res.returncode == 0, res.stderr
        assert len(pids) == 4, res.stdout + res.stderr  # two ranks, a child each
        deadline = time.monotonic() + 5
        while (alive := [p for p in pids if _alive(p, tag)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive == [], f"still running after ddlrun returned: {alive}"
    finally:
        for pid in pids:
            if _alive(pid, tag):
                os.kill(pid, signal.SIGKILL)
