"""ddlrun's flight recorder diagnosis (flight_report.py, pure) and jobs that need it: a
stuck rank is named as behind with where it is, a crash's peers say whom they waited on,
a desync shows where the calls differ; ddlrun --diagnose asks a live job."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ddlrun_testlib import PY, ddlrun_argv, marker, run_ddlrun  # noqa: F401
from doc_blocks import program_before, shown_after, stable

from ddlrun.diagnose import flight_folder
from ddlrun.flight_report import diagnose, frame_from_stacks


def _e(seq, state="done", name="allreduce", what="float32[4], Average", **kw):
    return {"queue": "job", "seq": seq, "name": name, "what": what, "state": state,
            "queued": 100.0, "started": 100.0, "ended": 101.0 if state == "done" else None,
            **kw}


def _flight(issued, open_=(), done=(), waits=(), t=130.0, at=None):
    f = {"time": t, "queues": {"job": {"issued": issued, "open": list(open_),
                                       "done": list(done)}}, "waits": list(waits)}
    if at:
        f["at"] = at
    return f


def test_the_rank_behind_is_named_with_where_it_is():
    flights = {
        0: _flight(6, open_=[_e(5, "failed", error="DDLTimeoutError")], done=[_e(4)],
                   waits=[{"peer": 1, "step": 6, "peer_step": 5}]),
        1: _flight(5, done=[_e(4)], at={"file": "/w/train.py", "line": 7, "function": "main"}),
        2: _flight(6, open_=[_e(5, "running")], done=[_e(4)]),
    }
    lines = diagnose(flights, 3, cwd="/w", dumps=["/d/rank0.json"])
    assert lines[0] == ("rank 1 is behind on the job's collectives: issued 5, while ranks 0, "
                        "2 issued 6 and wait in #5 allreduce(float32[4], Average)")
    assert lines[1] == ("  rank 1: last finished #4 allreduce(float32[4], Average), 29.0 s "
                        "earlier; now at train.py:7 in main")
    assert "rank 0: #5 allreduce(float32[4], Average) failed (DDLTimeoutError) waiting on " \
           "rank 1" in lines[2]
    assert lines[3].startswith("  rank 2: #5 allreduce(float32[4], Average) running for")
    assert lines[-1] == "dumps: /d/rank0.json"


def test_a_desync_shows_where_the_calls_differ_and_silent_ranks_are_said():
    flights = {0: _flight(3, open_=[_e(2, "failed", what="float32[7], Average")]),
               1: _flight(3, open_=[_e(2, "failed", what="float32[8], Average")]),
               2: None}
    lines = diagnose(flights, 3)
    assert lines[0] == "every rank that reported issued 3 of the job's collectives"
    assert any(ln.startswith("  they differ at #2: rank 0: #2 allreduce(float32[7], "
                             "Average); rank 1: #2 allreduce(float32[8], Average)")
               for ln in lines)
    assert lines[-1].startswith("no flight record from rank 2")


def test_nothing_to_say_without_flights_and_odd_input_is_dropped_not_fatal():
    assert diagnose({0: None, 1: {"queues": {}}}, 2) == []
    odd = [{"queues": []}, {"queues": {"job": {"issued": None}}},
           {"queues": {"job": {"issued": 2, "open": {"a": 1}}}, "time": "x"},
           {"queues": {"job": {"issued": 2, "open": ["s", {"seq": [1]}]}}, "waits": 3,
            "at": "here"}]
    for f in odd:
        diagnose({0: f, 1: _flight(3)}, 2)


def test_a_rank_that_did_not_answer_is_shown_at_its_c_level_frame():
    lines = diagnose({0: _flight(2, open_=[_e(1, "failed", error="DDLTimeoutError")])}, 2,
                     at={1: {"file": "/w/x.py", "line": 9, "function": "spin"}},
                     cwd="/w", unanswered=[1])
    assert "rank 1 did not answer (stuck outside Python?); its C-level stack: x.py:9 in " \
           "spin" in lines


def test_the_main_threads_frame_from_faulthandlers_text(tmp_path):
    code = ("import faulthandler, sys\n"
            "def inner():\n"
            "    faulthandler.dump_traceback(sys.stdout, all_threads=True)\n"
            "inner()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    f = frame_from_stacks(out)
    assert (f["file"], f["line"], f["function"]) == ("<string>", 3, "inner")
    assert frame_from_stacks("nothing here") is None


STUCK = """\
import time
import numpy as np
import ddl

ddl.init()
for step in range(5):
    ddl.allreduce(np.ones(4, np.float32))
if ddl.rank() == 1:
    time.sleep(600)  # stuck: in I/O, a debugger, a deadlock...
ddl.allreduce(np.ones(4, np.float32))
"""


def _script(tmp_path, text, name="job.py"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_a_timeout_names_the_stuck_rank_as_troubleshooting_shows(tmp_path):
    """The stuck rank is named first (the likely cause), with where it is; the block on
    docs/troubleshooting.md is this output."""
    script = _script(tmp_path, program_before(STUCK_MARK), "stuck.py")
    assert Path(script).read_text() == STUCK
    env = {**os.environ, "DDL_TIMEOUT": "5"}
    r = run_ddlrun("-n", "3", PY, script, timeout=180, env=env, cwd=str(tmp_path))
    assert r.returncode == 1, r.stderr
    summary = [t for t in (r.stdout + r.stderr).splitlines() if t.startswith("ddlrun:")]
    err = "\n".join(summary)
    assert re.match(r"ddlrun: rank 1 on host \S+ \(pid \d+\) is behind on the job's "
                    r"collectives and still running, at stuck\.py:9 in <module>: it is the "
                    r"likely cause", summary[0]), err
    assert "follow-on failures of rank 1" in err
    job = re.search(r"job (\S+) ended with exit code", err)[1]
    assert os.path.exists(os.path.join(flight_folder(job), "rank1.json"))
    shown = shown_after(STUCK_MARK)
    assert stable(summary) == stable(shown), err
    assert re.search(r"rank 1: last finished #4 allreduce\(float32\[4\], Average\), begun [0-9.]+ "
                     r"s earlier; now at stuck\.py:9 in <module>", err), err


CRASH = """\
import numpy as np, ddl
ddl.init()
a = np.ones(7, np.float32)
for step in range(6):
    if ddl.rank() == 2 and step == 3:
        raise ValueError("boom")
    ddl.allreduce(a)
"""


def test_a_crash_the_peers_say_whom_they_waited_on(tmp_path):
    r = run_ddlrun("-np", "3", PY, _script(tmp_path, CRASH), timeout=120, cwd=str(tmp_path))
    assert r.returncode == 1
    err = r.stderr
    assert "rank 2 on host" in err and "ValueError: boom at job.py:6" in err, err
    assert ("flight recorder: rank 2 is behind on the job's collectives: issued 3, while "
            "ranks 0, 1 issued 4 and wait in #3 allreduce(float32[7], Average)") in err, err
    assert re.search(r"rank 0: #3 allreduce\(float32\[7\], Average\) failed \(DDLPeerError\) "
                     r"waiting on rank 2", err), err


STUCK_MARK = "kept true by tests/launcher/test_flight_report.py (paths"
DDP_CRASH_MARK = "kept true by tests/launcher/test_flight_report.py: the DDP crash"


def test_a_ddp_crash_as_troubleshooting_shows(tmp_path):
    pytest.importorskip("torch")
    path = _script(tmp_path, program_before(DDP_CRASH_MARK), "train.py")
    r = run_ddlrun("-n", "2", PY, path, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 1, r.stderr
    summary = [t for t in (r.stdout + r.stderr).splitlines() if t.startswith("ddlrun:")]
    assert stable(summary) == stable(shown_after(DDP_CRASH_MARK)), "\n".join(summary)


def test_ddlrun_diagnose_asks_a_live_job(tmp_path, marker):  # noqa: F811
    script = _script(tmp_path, STUCK.replace("# stuck", f"# {marker}"))
    env = {**os.environ, "DDL_TIMEOUT": "60"}
    job = f"diag{os.getpid()}{marker[-6:]}"
    p = subprocess.Popen(ddlrun_argv("-np", "2", "--job-id", job, PY, script, marker),
                         env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        folder = flight_folder(job)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(os.path.exists(os.path.join(folder, f"rank{r}.pid")) for r in (0, 1)):
                break
            time.sleep(0.2)
        time.sleep(2)  # both past their five collectives: rank 0 waits, rank 1 sleeps
        d = run_ddlrun("--diagnose", job, timeout=60, cwd=str(tmp_path))
        assert d.returncode == 0, d.stderr
        out = d.stdout + d.stderr
        assert "rank 1 is behind on the job's collectives: issued 5, while rank 0 issued 6" \
            in out, out
        assert "now at job.py:9 in <module>" in out, out
        assert "rank 0 (pid" in out and "rank 1 (pid" in out
        assert p.poll() is None  # asking did not stop the job
    finally:
        p.terminate()  # ddlrun stops its ranks and tidies the job's flight folder
        p.communicate(timeout=60)
    left = os.listdir(folder) if os.path.exists(folder) else []
    assert not [n for n in left if n.endswith(".pid")], left  # the dumps it asked for stay
    shutil.rmtree(folder, ignore_errors=True)
    bad = run_ddlrun("--diagnose", "no-such-job-x", timeout=30)
    assert bad.returncode != 0 and "no job 'no-such-job-x' on this host" in bad.stderr
