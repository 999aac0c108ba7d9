"""Root cause, not first exit: a rank that dies of an ordinary exception is named, never a
peer that failed because of it, though the peer's error is often raised (and its process
gone) before the failing rank's interpreter has finished dying. The rules on a scripted
backend; then real jobs through ddlrun: a crash on a random rank of a numpy ddl script, of
DDP on the ``ddl`` torch backend, of Keras ``fit`` with ddl.keras, over the agents' protocol
(ssh) and under mpirun. Every run must name the right rank with its exception and frame."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import re
import socket
import time

import pytest
from ddlrun_testlib import HERE, PY, run_ddlrun
from test_supervise import AgentsHere, Scripted, notes, plan_of

from ddlrun import envs
from ddlrun.backends import LaunchOptions
from ddlrun.backends.mpirun import MpirunBackend
from ddlrun.events import RankExit
from ddlrun.failures import FailureRecord, RecordFolder, read_record, tier
from ddlrun.hosts import HostSpec
from ddlrun.output import OutputSink
from ddlrun.plan import Request, make_plan
from ddlrun.rankenv import compute
from ddlrun.run import supervise

CRASH = str(HERE / "scripts" / "crash.py")
CRASH_LINE = next(i for i, ln in enumerate((HERE / "scripts" / "crash.py").read_text()
                                           .splitlines(), 1) if ln.endswith("# CRASH"))
SEED = int(os.environ.get("DDLRUN_FAULT_SEED", "20261203"))
ENV = {**os.environ, "DDL_TIMEOUT": "20", "DDL_SHM_HEAP_BYTES": str(4 * 2**20)}


def rec(kind="ValueError", msg="boom", t=0.0, after_peer=False, file="/w/train.py", line=42):
    return FailureRecord(kind, msg, time.time() + t, after_peer, file, line, "train")


# ------------------------------------------------------------------------- the rules
def test_a_peers_error_that_exited_first_is_not_blamed():
    t = time.monotonic()
    peer = rec("RuntimeError", "DDLPeerError: rank 0: rank 1's process is exiting", 0.01,
               after_peer=True)
    script = [(0.0, RankExit(0, 0, 1, 100, t, peer)),
              (0.05, RankExit(1, 0, 1, 101, t + 0.05, rec(t=0.0)))]
    err = io.StringIO()
    out = supervise(plan_of(2), Scripted(script), OutputSink(stdout=io.StringIO(), stderr=err))
    assert (out.code, out.failure.rank) == (1, 1)
    lines = notes(err)
    assert lines[0] == ("rank 1 on host localhost (pid 101) failed: ValueError: boom at "
                        "/w/train.py:42 (exited with code 1); stopping the other ranks")
    assert any(ln.startswith("then rank 0 (exited with code 1): follow-on failures of rank 1")
               for ln in lines), lines


def test_the_cause_is_awaited_beyond_the_settle_window_while_all_are_consequences():
    t = time.monotonic()
    script = [(0.0, RankExit(0, 0, 1, 100, t, rec(t=0.5, after_peer=True))),
              (1.2, RankExit(1, 0, 7, 101, t + 1.2, rec(t=0.0)))]  # 1.2 s: long past settle
    err = io.StringIO()
    out = supervise(plan_of(2), Scripted(script), OutputSink(stdout=io.StringIO(), stderr=err))
    assert (out.code, out.failure.rank) == (7, 1), err.getvalue()


def test_a_killed_rank_without_a_record_is_a_cause_and_sigterm_of_a_teardown_is_not():
    t = time.monotonic()
    script = [(0.0, RankExit(2, 0, -15, 102, t)),  # an agent's teardown: no cause
              (0.0, RankExit(0, 0, 1, 100, t + 0.01, rec(t=0.0, after_peer=True))),
              (0.05, RankExit(1, 0, -9, 101, t + 0.02))]
    out = supervise(plan_of(3), Scripted(script), OutputSink(stdout=io.StringIO(),
                                                             stderr=io.StringIO()))
    assert (out.code, out.failure.rank) == (137, 1)


def test_of_two_root_causes_the_earlier_record_wins_and_the_other_is_named():
    t = time.monotonic()
    script = [(0.0, RankExit(0, 0, 1, 100, t, rec("KeyError", "'x'", t=0.2))),
              (0.05, RankExit(1, 0, 2, 101, t + 0.05, rec(t=0.1)))]
    err = io.StringIO()
    out = supervise(plan_of(2), Scripted(script), OutputSink(stdout=io.StringIO(), stderr=err))
    assert (out.code, out.failure.rank) == (2, 1)
    assert ("rank 0 on host localhost (pid 100) failed too, later: KeyError: 'x' at "
            "/w/train.py:42 (exited with code 1)") in notes(err)


def test_only_consequences_name_the_earliest_and_say_no_cause_was_reported():
    t = time.monotonic()
    script = [(0.0, RankExit(1, 0, 1, 101, t, rec("DDLTimeoutError", "timed out", 0.1, True))),
              (0.0, RankExit(0, 0, 1, 100, t, rec("DDLTimeoutError", "timed out", 0.0, True)))]
    err = io.StringIO()
    out = supervise(plan_of(2), Scripted(script), OutputSink(stdout=io.StringIO(), stderr=err))
    assert out.failure.rank == 0
    assert any("no rank reported a cause of its own" in ln for ln in notes(err))


def test_tiers():
    assert tier(rec(), 1) == 0 and tier(None, -9) == 0 and tier(None, 3) == 0
    assert tier(rec(after_peer=True), 1) == 1 and tier(None, -15) == 2


def test_records_are_read_whole_or_not_at_all(tmp_path):
    folder = RecordFolder("jrec", base=str(tmp_path))
    assert os.stat(folder.folder).st_mode & 0o777 == 0o700
    assert folder.read(0) is None
    with open(folder.path(0), "w") as f:
        json.dump({"type": "ValueError", "message": "boom", "time": 5.0, "after_peer": False,
                   "file": "/w/t.py", "line": 3}, f)
    got = folder.read(0)
    assert got.summary("/w") == "ValueError: boom at t.py:3" and not got.after_peer
    for bad in ("{", "[]", '{"type": "X"}', "x" * 70_000):
        with open(folder.path(1), "w") as f:
            f.write(bad)
        assert read_record(folder.path(1)) is None
    folder.remove()
    assert not os.path.exists(folder.folder)


def test_rankenv_puts_the_record_in_the_folder_where_it_exists(tmp_path):
    env = {"OMPI_COMM_WORLD_RANK": "3", envs.DDLRUN_RANK_HOSTS: "0,0,1,1",
           envs.DDLRUN_ERROR_DIR: str(tmp_path)}
    assert compute(env, 8)[envs.DDL_ERROR_FILE] == str(tmp_path / "rank-3.json")
    env[envs.DDLRUN_ERROR_DIR] = str(tmp_path / "not-on-this-host")
    assert envs.DDL_ERROR_FILE not in compute(env, 8)


# ------------------------------------------------------------------------- real jobs
def named(stderr: str) -> tuple[int | None, str]:
    m = re.search(r"^ddlrun: rank (\d+) .*$", stderr, re.M)
    return (int(m.group(1)), m.group(0)) if m else (None, "")


def check_named(res, victim: int, what: str) -> list[str]:
    """What is wrong with the summary of a job whose rank ``victim`` crashed."""
    rank, line = named(res.stderr)
    want = (f"failed: ValueError: boom on rank {victim} at tests/launcher/scripts/crash.py:"
            f"{CRASH_LINE} (exited with code 1)")
    problems = []
    if rank != victim or want not in line:
        problems.append(f"{what}: named {line!r}, want rank {victim} {want!r}")
    if res.returncode != 1:
        problems.append(f"{what}: exit code {res.returncode}, want 1")
    # (torch prefixes its ranks' tracebacks with "[rankN]: ")
    if not re.search(rf"^ddlrun:   \| (\[rank{victim}\]: )?ValueError: boom on rank {victim}$",
                     res.stderr, re.M):
        problems.append(f"{what}: the summary lacks the failing rank's own last line")
    if "called ddl.shutdown()" in res.stderr:
        problems.append(f"{what}: a peer was told the crashed rank called ddl.shutdown()")
    return problems + ([f"{what}: stderr tail {res.stderr[-1500:]!r}"] if problems else [])


def crash_runs(capsys, mode: str, runs: int, seed: int, timeout: float) -> list[str]:
    """``runs`` jobs (``DDLRUN_CRASH_RUNS`` overrides: 100 by hand) of 2 or 3 ranks, each
    with a random rank crashing; what went wrong. The counts are printed."""
    runs = int(os.environ.get("DDLRUN_CRASH_RUNS", runs))
    rng = random.Random(seed)
    problems, failed, slowest = [], 0, 0.0
    for i in range(runs):
        n = rng.choice((2, 3))
        victim = rng.randrange(n)
        args = [mode, str(victim), *([str(rng.randrange(1, 20))] if mode == "numpy" else [])]
        t0 = time.monotonic()
        res = run_ddlrun("-n", str(n), PY, CRASH, *args, timeout=timeout, env=ENV,
                         cwd=str(HERE.parent.parent))
        slowest = max(slowest, time.monotonic() - t0)
        found = check_named(res, victim, f"{mode} run {i} ({n} ranks, victim {victim})")
        problems += found
        failed += bool(found)
    with capsys.disabled():
        print(f"\n[failure records] {mode} crash on a random rank (seed {seed}, slowest run "
              f"{slowest:.1f}s): tried {runs}, named right {runs - failed}")
    return problems


def test_a_numpy_crash_on_a_random_rank_is_named_every_time(capsys):
    assert crash_runs(capsys, "numpy", 6, SEED, 60) == []


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_a_ddp_crash_on_a_random_rank_is_named_every_time(capsys):
    assert crash_runs(capsys, "ddp", 2, SEED + 1, 180) == []


# (found, not imported: importing TensorFlow here would cost every run of this module)
@pytest.mark.tensorflow
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None
                    or importlib.util.find_spec("keras") is None, reason="needs tensorflow")
def test_a_keras_fit_crash_on_a_random_rank_is_named(capsys):
    assert crash_runs(capsys, "keras", 1, SEED + 2, 300) == []


def test_the_record_travels_with_the_exit_over_the_agents_protocol(marker):
    # two "hosts" on this one: shared memory inside each, gloo across
    hosts = (HostSpec("h0", 2), HostSpec("h1", 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plan = make_plan(Request((PY, CRASH, "numpy", "2", "3"), hosts, master_addr="127.0.0.1"),
                     {}, f"rec{marker[-8:]}", port, {}, {envs.DDL_JOB_SECRET: marker})
    err = io.StringIO()
    backend = AgentsHere(LaunchOptions(grace=2.0, cwd=str(HERE.parent.parent)))
    out = supervise(plan, backend, OutputSink(stdout=io.StringIO(), stderr=err), timeout=60)
    assert (out.code, out.failure.rank) == (1, 2), err.getvalue()
    assert out.failure.record is not None and not out.failure.record.after_peer
    assert notes(err)[0].startswith(
        f"rank 2 on host h1 (pid {out.failure.pid}) failed: ValueError: boom on rank 2 at "
        f"tests/launcher/scripts/crash.py:{CRASH_LINE}"), err.getvalue()
    assert not [p for p in os.listdir("/tmp") if p.startswith(f"ddlrun-{plan.job_id}-")]


@pytest.mark.skipif(not MpirunBackend.exists(), reason="needs mpirun")
def test_mpirun_names_the_rank_from_the_records():
    res = run_ddlrun("--launcher", "mpirun", "-n", "3", PY, CRASH, "numpy", "1", "4",
                     timeout=120, env=ENV, cwd=str(HERE.parent.parent))
    want = (f"ddlrun: rank 1 on host localhost failed first: ValueError: boom on rank 1 at "
            f"tests/launcher/scripts/crash.py:{CRASH_LINE}")
    assert want in res.stderr.splitlines(), res.stderr[-3000:]
    then = [ln for ln in res.stderr.splitlines() if ln.startswith("ddlrun: then ")]
    # (mpirun may stop a peer before it has written its record)
    assert all(ln.endswith("follow-on failures of rank 1 (their output is above)")
               for ln in then), res.stderr[-3000:]


def test_the_record_folder_is_private_and_removed(tmp_path):
    """The folder is 0700 while the job runs (a rank sees its own path) and gone after."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os, stat, sys\n"
                     "d = os.path.dirname(os.environ['DDL_ERROR_FILE'])\n"
                     "print(d, oct(stat.S_IMODE(os.stat(d).st_mode)), flush=True)\n")
    res = run_ddlrun("-n", "2", PY, str(probe), timeout=60, env=ENV)
    assert res.returncode == 0, res.stderr
    folders = {ln.split()[1]: ln.split()[2] for ln in res.stdout.splitlines()}
    assert len(folders) == 1 and list(folders.values()) == ["0o700"]
    assert not os.path.exists(next(iter(folders)))
