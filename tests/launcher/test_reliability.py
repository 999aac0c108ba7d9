"""Fault injection with real processes, counted: ranks SIGKILLed or SIGSTOPped at a random
collective, a failing rank whose child holds its stdout, 64 MiB without a newline beside a
collective loop, and ddlrun itself SIGKILLed with its janitor (its ranks' shared memory is
then swept; ddlrun SIGKILLed alone: test_shm_cleanup.py).

Every run must name the right rank first, exit with the right code, leave no process (by
the pids the ranks announced, never by name) and no /dev/shm segment of its job, and end in
bounded time. The counts are printed (docs/reliability.md records them).
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from ddlrun_testlib import HERE, PY, ddlrun_argv, janitor_of, pid_alive, run_ddlrun, shm_left

FAULTS = str(HERE / "scripts" / "faults.py")
TIMEOUT = 2  # DDL_TIMEOUT of the jobs: survivors of a stopped rank give up after this
ENV = {**os.environ, "DDL_TIMEOUT": str(TIMEOUT), "DDL_SHM_HEAP_BYTES": str(4 * 2**20)}
SEED = int(os.environ.get("DDLRUN_FAULT_SEED", "20261201"))
RUN_LIMIT = 30.0  # seconds: a run that takes longer is a hang


def announced(stdout: str) -> list[tuple[int, str]]:
    """(pid, start time) of every process a job's ranks announced."""
    return [(int(m.group(1)), m.group(2))
            for m in re.finditer(r"^\[\d+\] pid (\d+) (\d+)$", stdout, re.M)]




def left_alive(pids: list[tuple[int, str]], within: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within
    while True:
        left = [pid for pid, start in pids if pid_alive(pid, start)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    return left


def named_first(stderr: str) -> tuple[int | None, str]:
    """The rank the summary names first, and that line."""
    m = re.search(r"^ddlrun: rank (\d+) .*$", stderr, re.M)
    return (int(m.group(1)), m.group(0)) if m else (None, "")


def report(capsys, what: str, tried: int, failed: int, problems: list[str]) -> None:
    with capsys.disabled():
        print(f"\n[reliability] {what}: tried {tried}, survived {tried - failed}")
        for p in problems:
            print(f"[reliability]   {p}")


def fault_run(job: str, victim: int, at: int, action: str) -> tuple[list[str], float]:
    """One 3-rank job of 25 allreduces; returns what went wrong (empty: all right)."""
    t0 = time.monotonic()
    try:
        res = run_ddlrun("-n", "3", "--job-id", job, "--grace", "2", PY, FAULTS, "collectives",
                         "25", str(victim), str(at), action, timeout=RUN_LIMIT, env=ENV)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        left_alive(announced(out), 0)
        return [f"{job}: hang (no end within {RUN_LIMIT:g}s)"], time.monotonic() - t0
    took = time.monotonic() - t0
    rank, line = named_first(res.stderr)
    want_code, want_text = {"kill": (137, "was killed by SIGKILL"),
                            "stop": (1, "is stopped (state T, SIGSTOP?): it is the likely cause"),
                            "child3": (3, "exited with code 3")}[action]
    problems = []
    if rank != victim or want_text not in line:
        problems.append(f"{job}: named {line!r}, want rank {victim} {want_text!r}")
    if res.returncode != want_code:
        problems.append(f"{job}: exit code {res.returncode}, want {want_code}")
    if action == "child3" and f"  | rank {victim} fails now" not in res.stderr:
        problems.append(f"{job}: the summary lacks the failing rank's last line")
    pids = announced(res.stdout)
    if len(pids) < 3:
        problems.append(f"{job}: only {len(pids)} ranks announced themselves")
    left = left_alive(pids)
    if left:
        problems.append(f"{job}: processes left running: {left}")
    if shm_left(job):
        problems.append(f"{job}: shared memory left: {shm_left(job)}")
    if problems:
        problems.append(f"{job}: stderr tail: {res.stderr[-600:]!r}")
    return problems, took


@pytest.mark.slow
def test_random_rank_killed_or_stopped_at_a_random_collective(marker, capsys):
    rng = random.Random(SEED)
    problems, failed, slowest = [], 0, 0.0
    runs = 20
    for i in range(runs):
        victim, at, action = rng.randrange(3), rng.randrange(20), rng.choice(("kill", "stop"))
        job = f"rel{i}_{marker[-8:]}"
        found, took = fault_run(job, victim, at, action)
        if took > TIMEOUT + 10:
            found.append(f"{job}: {action} of rank {victim} took {took:.1f}s to end")
        problems += found
        failed += bool(found)
        slowest = max(slowest, took)
    report(capsys, f"SIGKILL/SIGSTOP of a random rank at a random collective (seed {SEED}, "
           f"slowest run {slowest:.1f}s)", runs, failed, problems)
    assert problems == []


@pytest.mark.slow
def test_failing_rank_whose_child_holds_its_stdout_is_named(marker, capsys):
    rng = random.Random(SEED + 1)
    problems, failed = [], 0
    runs = 10
    for i in range(runs):
        found = fault_run(f"cho{i}_{marker[-8:]}", 1, rng.randrange(10), "child3")[0]
        problems += found
        failed += bool(found)
    report(capsys, "rank 1 exits 3 leaving a child that holds its stdout", runs, failed,
           problems)
    assert problems == []


@pytest.mark.slow
def test_64_mib_without_a_newline_beside_a_collective_loop(marker):
    t0 = time.monotonic()
    res = run_ddlrun("-n", "2", "--job-id", f"big_{marker[-8:]}", PY, FAULTS, "bigline", "64",
                     "200", timeout=120, env=ENV)
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-2000:]
    assert took < 60, f"took {took:.1f}s"
    assert "[0] rank 0 allreduces ok" in res.stderr and "[1] rank 1 allreduces ok" in res.stderr
    pieces = [ln for ln in res.stdout.splitlines() if ln.startswith("[0] y")]
    assert sum(len(p) - 4 for p in pieces) == 200 * (64 * 2**20 // 200)
    assert max(len(p) for p in pieces) <= 4 + 65536  # forwarded in tagged pieces


# ---------------------------------------------------------------------------- ddlrun killed
def start_job(job: str, nranks: int = 3) -> tuple[subprocess.Popen, list[tuple[int, str]]]:
    """A job whose ranks ddl.malloc and wait; ddlrun in its own process group."""
    proc = subprocess.Popen(ddlrun_argv("-n", str(nranks), "--job-id", job, PY, FAULTS,
                                        "malloc"),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=ENV, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    out, deadline = "", time.monotonic() + RUN_LIMIT
    while out.count(" ready\n") < nranks:
        try:
            out += lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"job {job} did not get ready: {out!r}")
    return proc, announced(out)


def age(job: str, seconds: float = 60.0) -> None:
    """Make a job's segments look older than the sweep's grace."""
    t = time.time() - seconds
    for name in shm_left(job):
        os.utime(f"/dev/shm/{name}", (t, t))


def kill_ddlrun(proc: subprocess.Popen, pids: list[tuple[int, str]]) -> None:
    """SIGKILL to ddlrun's janitor, then to ddlrun's process group (the whole tree killed
    at once, as by the OOM killer or ``kill -9 -1``: nothing cleans up after the job)."""
    janitor = janitor_of(proc.pid)
    assert janitor is not None, "ddlrun started no janitor"
    os.kill(janitor, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)  # ddlrun's own group: the ranks have their sessions
    proc.wait(timeout=10)
    assert left_alive(pids) == []  # PR_SET_PDEATHSIG took the ranks with it


def test_sigkill_of_ddlrun_and_its_janitor_leaks_nothing_a_later_ddlrun_does_not_remove(
        marker):
    from ddl.engines import orphans

    job = f"kill_{marker[-8:]}"
    proc, pids = start_job(job)
    try:
        live = shm_left(job)
        assert len(live) == 3, live  # one heap segment per rank
        # a sweep while the job runs never takes its segments, old as they may look
        assert not set(live) & set(orphans.find_orphans(grace=0.0))
        age(job)
        res = run_ddlrun("--cleanup")
        assert res.returncode == 0 and not any(n in res.stdout for n in live), res.stdout
        assert shm_left(job) == live
    finally:
        kill_ddlrun(proc, pids)
    assert shm_left(job) == live  # the ranks died without cleaning up
    res = run_ddlrun("--cleanup")
    assert res.returncode == 0, res.stderr
    assert sorted(re.findall(rf"removed /dev/shm/(ddl-{job}-\S+)", res.stdout)) == sorted(live)
    assert shm_left(job) == []

    job2 = f"kill2_{marker[-8:]}"
    proc, pids = start_job(job2)
    kill_ddlrun(proc, pids)
    assert len(shm_left(job2)) == 3
    age(job2)
    res = run_ddlrun("-n", "1", "true")  # any later ddlrun sweeps at start
    assert res.returncode == 0, res.stderr
    assert re.search(r"^ddlrun: removed [3-9]\d* orphaned shared-memory segment\(s\) of killed "
                     r"jobs \(\d+\.\d MiB; see ddlrun --cleanup\)$", res.stderr, re.M), res.stderr
    assert shm_left(job2) == []


def test_failed_runs_print_their_job_id(marker):
    job = f"jid_{marker[-8:]}"
    res = run_ddlrun("-n", "2", "--job-id", job, PY, "-c", "raise SystemExit(4)")
    assert res.returncode == 4
    assert f"ddlrun: job {job} ended with exit code 4" in res.stderr
    assert Path("/dev/shm").is_dir() and shm_left(job) == []
