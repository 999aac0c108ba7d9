"""What a rank leaves running in a session of its own (issue 28, item 4).

A helper started with ``start_new_session=True`` (as some data-loading and profiling
libraries do) or a double-forked daemon is outside the rank's process group, so the
teardown's ``killpg`` misses it, and once the rank is gone it used to belong to init and
outlive the job. ddlrun and the per-host agent are child subreapers and end such strays by
pid within the teardown deadline (launcher/ddlrun/reaper.py), whether a rank crashed or
every rank exited 0. Checked by the pid and start time every rank announced, never by name.

Run by hand for the issue's count (a rank's session helper, then the rank crashes)::

    .venv/bin/python tests/launcher/test_strays.py 3
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddlrun_testlib import HERE, PY, ddlrun_argv, pid_alive  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

STRAYS = str(HERE / "scripts" / "strays.py")
GRACE = 1.0  # ddlrun --grace: the teardown deadline
LIMIT = 20.0  # seconds a job may take, ddlrun's own start on a busy 2-core machine included
CODES = {"crash": 1, "exit0": 0}


def announced(stdout: str) -> list[tuple[int, str]]:
    """(pid, start time) of every helper the ranks announced."""
    return [(int(m.group(1)), m.group(2))
            for m in re.finditer(r"^\[\d+\] helper (\d+) (\d+)$", stdout, re.M)]




def left_alive(helpers: list[tuple[int, str]], within: float = GRACE) -> list[int]:
    """The helpers still alive ``within`` seconds from now (at once when none is)."""
    deadline = time.monotonic() + within
    while True:
        left = [pid for pid, start in helpers if pid_alive(pid, start)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def run_job(how: str, end: str, marker: str, nranks: int = 2) -> tuple[int, float, str, str]:
    """ddlrun as a real process; (exit code, seconds, stdout, stderr)."""
    with tempfile.TemporaryDirectory(prefix="ddlstrays-") as folder:
        t0 = time.monotonic()
        proc = subprocess.run(ddlrun_argv("-n", str(nranks), "--grace", f"{GRACE:g}", PY,
                                          STRAYS, how, end, marker, folder),
                              capture_output=True, text=True, timeout=60)
        return proc.returncode, time.monotonic() - t0, proc.stdout, proc.stderr


@pytest.mark.parametrize("how,end", [("session", "crash"), ("session", "exit0"),
                                     ("daemon", "crash"), ("daemon", "exit0")])
def test_ddlrun_ends_what_the_ranks_left_in_sessions_of_their_own(marker, how, end):
    code, took, out, err = run_job(how, end, marker)
    helpers = announced(out)
    assert code == CODES[end], err
    assert len(helpers) == 2, out + err
    assert left_alive(helpers) == [], err  # rank 1's ignores SIGTERM: the SIGKILL ended it
    assert took < LIMIT, err


# ---------------------------------------------------------------------------- agents
@pytest.mark.parametrize("how,end", [("session", "crash"), ("daemon", "exit0")])
def test_agent_ends_what_the_ranks_left_in_sessions_of_their_own(monkeypatch, marker, how,
                                                                 end):
    """The ssh backend's agents on this host, as over ssh: one rank per "host"."""
    from ddlrun.backends import LaunchOptions
    from ddlrun.backends.ssh import AgentBackend
    from ddlrun.hosts import HostSpec
    from ddlrun.output import OutputSink
    from ddlrun.plan import Request, make_plan
    from ddlrun.run import supervise

    class AgentsHere(AgentBackend):
        name = "agents-here"

        def transport(self, host, connect_timeout=None):
            return []

    monkeypatch.delenv("RANK", raising=False)
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory(prefix="ddlstrays-") as folder:
        program = (PY, STRAYS, how, end, marker, folder)
        plan = make_plan(Request(program, (HostSpec("h0", 1), HostSpec("h1", 1))), {},
                         f"st_{marker[-10:]}", 29500, {}, {"DDL_JOB_SECRET": marker})
        t0 = time.monotonic()
        outcome = supervise(plan, AgentsHere(LaunchOptions(grace=GRACE)),
                            OutputSink(stdout=out, stderr=err), timeout=LIMIT)
        took = time.monotonic() - t0
    helpers = announced(out.getvalue())
    assert outcome.code == CODES[end], err.getvalue()
    assert len(helpers) == 2, out.getvalue() + err.getvalue()
    assert left_alive(helpers) == [], err.getvalue()
    assert took < LIMIT, err.getvalue()


# ---------------------------------------------------------------------------- reaping
SUBREAPER = r"""
import json, os, sys, threading
from ddlrun import reaper
from ddlrun.procs import ProcessSet, ProcSpec

RANK = '''
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *a: os._exit(7))
helper = [sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]]
subprocess.Popen(helper, start_new_session=True, stdout=subprocess.DEVNULL)
if os.fork() == 0:  # a daemon: given to the subreaper at once
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, helper)
    os._exit(0)
os.wait()
print('ready', flush=True)
time.sleep(600)
'''

assert reaper.become_subreaper() and reaper.is_subreaper()
ready, codes = threading.Event(), []
procs = ProcessSet(lambda key, stream, line: ready.set(), lambda e: codes.append(e.code))
procs.start([ProcSpec(0, (sys.executable, '-c', RANK, sys.argv[1]), dict(os.environ))])
assert ready.wait(30)
strays = procs.strays()
procs.close(timeout=2.0)
me = os.getpid()
print(json.dumps({"codes": codes, "strays": len(strays),
                  "alive": [s.pid for s in strays if reaper.alive(s)],
                  "children": [p for p, r in reaper.table().items() if r.ppid == me]}))
"""


def test_a_subreaper_reaps_its_orphans_but_not_the_exit_status_of_its_children(marker):
    """The rank exits 7 on SIGTERM while the teardown reaps the daemon given to us: its
    exit code still reaches ``Popen.wait``, and no child of ours is left (not even a
    zombie)."""
    proc = subprocess.run([PY, "-c", SUBREAPER, marker], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"codes": [7], "strays": 2, "alive": [], "children": []}, result


def test_a_process_that_is_no_subreaper_touches_no_child_it_did_not_start():
    """``strays`` in a plain process (a test, ``ddl.perf.spawn``): this test's own child
    is neither signalled nor reaped by a ProcessSet's teardown."""
    from ddlrun.procs import ProcessSet, ProcSpec

    mine = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
    try:
        procs = ProcessSet(lambda *a: None, lambda e: None)
        procs.start([ProcSpec(0, (PY, "-c", "pass"), dict(os.environ))])
        procs.close(timeout=1.0)
        assert mine.poll() is None
    finally:
        mine.kill()
    assert mine.wait(10) == -9


# ---------------------------------------------------------------------------- units
def test_descendants_follow_parent_pids_to_any_depth_roots_excluded():
    from ddlrun.reaper import Proc, Row, descendants

    rows = {10: Row(1, 100, "S"), 11: Row(10, 101, "S"), 12: Row(11, 102, "Z"),
            13: Row(1, 103, "S"), 14: Row(13, 104, "S"), 15: Row(10, 105, "T")}
    assert sorted(descendants(rows, [10])) == [Proc(11, 101), Proc(12, 102), Proc(15, 105)]
    assert descendants(rows, [12]) == []


def test_a_pid_whose_start_time_differs_is_never_signalled():
    """The walk's (pid, start) names one process: another start time is a reused pid."""
    from ddlrun.reaper import Proc, alive, signal_proc, stat_fields

    child = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
    try:
        start = int(stat_fields(child.pid)[19])
        assert alive(Proc(child.pid, start)) and not alive(Proc(child.pid, start + 1))
        assert not signal_proc(Proc(child.pid, start + 1), signal.SIGKILL)
        assert child.poll() is None
        assert signal_proc(Proc(child.pid, start), signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


# ---------------------------------------------------------------------------- by hand
def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 3
    good = 0
    for i in range(n):
        marker = f"ddlstrays-{os.getpid()}-{i}"
        code, took, out, err = run_job("session", "crash", marker)
        helpers = announced(out)
        left = left_alive(helpers)
        ok = code == 1 and len(helpers) == 2 and not left and took < LIMIT
        good += ok
        print(f"{i + 1:3d} exit {code}, {took:.2f}s, helpers {[p for p, _ in helpers]}, "
              f"alive after ddlrun: {left}{'' if ok else '  PROBLEM'}", flush=True)
        for pid, start in helpers:  # leave nothing behind, by pid and start time
            if pid_alive(pid, start):
                os.kill(pid, signal.SIGKILL)
    print(f"\n{good} of {n} trials: every helper gone when ddlrun exited")
    return 0 if good == n else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
