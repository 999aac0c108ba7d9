"""``ddlrun --max-restarts N`` (torchrun's restarts, one host): real jobs whose ranks decide
from TORCHELASTIC_RESTART_COUNT what each start does (scripts/restarts.py). A failure
stops every rank and starts the whole job again, as a new job (id, port, secret, shared
memory), with the torchrun variables set; restarts used up, the failing rank's code;
signals end the run at any point; nothing is left behind; bad values are one usage line."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from ddlrun_testlib import HERE, PY, ddlrun_argv, run_ddlrun, shm_left, wait_gone

from ddlrun.cli import MAX_RESTARTS, build_parser, config_from_args
from ddlrun.config import Config
from ddlrun.errors import UsageError
from ddlrun.plan import attempt_job_id
from ddlrun.steps import JobInputs, restart_inputs

SCRIPT = str(HERE / "scripts" / "restarts.py")


def seen(outdir) -> dict[tuple[int, int], dict]:
    """(attempt, rank) -> the torchrun variables that start of that rank saw."""
    out = {}
    for path in outdir.glob("a*.r*.json"):
        attempt, rank = path.stem[1:].split(".r")
        out[(int(attempt), int(rank))] = json.loads(path.read_text())
    return out


def sums(stdout: str) -> dict[int, dict]:
    """rank -> its JSON report (from the tagged lines ``[R] {...}``)."""
    found = {}
    for line in stdout.splitlines():
        _, _, text = line.partition("] ")
        if text.startswith("{"):
            report = json.loads(text)
            found[report["rank"]] = report
    return found


def left_behind(*jobs: str) -> list[str]:
    return [name for job in jobs for name in shm_left(job)]


def test_a_rank_that_fails_once_restarts_the_job_which_then_completes(marker, tmp_path):
    job = f"rs_{marker[-8:]}"
    out = tmp_path / "seen"
    out.mkdir()
    res = run_ddlrun("-n", "3", "--max-restarts", "3", "--job-id", job, "--log-dir",
                     str(tmp_path / "logs"), PY, SCRIPT, "once", marker, str(out), "1",
                     timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # today's failure report names the root cause, then one line for the restart
    assert "rank 1 on host localhost (pid " in res.stderr
    assert "failed: ValueError: boom on rank 1" in res.stderr
    restarts = [ln for ln in res.stderr.splitlines() if "restart 1 of 3" in ln]
    assert len(restarts) == 1, res.stderr
    assert restarts[0].startswith("ddlrun: rank 1 failed (ValueError: boom on rank 1 at ")
    assert restarts[0].endswith(f"exited with code 1); restart 1 of 3 (job {job}.r1)")
    assert "restart 2" not in res.stderr
    # every rank of the second start saw it as restart 1 of 3 of the same run, in a new job
    env = seen(out)
    assert sorted(env) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    for rank in range(3):
        first, second = env[(0, rank)], env[(1, rank)]
        assert first["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert second["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert first["TORCHELASTIC_MAX_RESTARTS"] == second["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert first["TORCHELASTIC_RUN_ID"] == second["TORCHELASTIC_RUN_ID"] == job
        assert (first["DDL_JOB_ID"], second["DDL_JOB_ID"]) == (job, f"{job}.r1")
        assert first["DDL_JOB_SECRET"] != second["DDL_JOB_SECRET"]  # a new rendezvous
        assert first["MASTER_PORT"] != second["MASTER_PORT"]
    # the new attempt formed a job of its own: the allreduce is right on every rank
    reports = sums(res.stdout)
    assert sorted(reports) == [0, 1, 2], res.stdout
    for report in reports.values():
        assert report == {**report, "attempt": 1, "sum": [6.0] * 4}
    # each attempt's logs in a folder of its own job id
    assert "ValueError: boom" in (tmp_path / "logs" / job / "rank.1.err").read_text()
    assert '"attempt": 1' in (tmp_path / "logs" / f"{job}.r1" / "rank.1.out").read_text()
    assert left_behind(job, f"{job}.r1") == []
    assert wait_gone(marker) == []


def test_restarts_used_up_end_with_the_failing_ranks_code(marker, tmp_path):
    job = f"rx_{marker[-8:]}"
    res = run_ddlrun("-n", "2", "--max_restarts=2", "--job-id", job, PY, SCRIPT, "always",
                     marker, str(tmp_path), "1", "7", timeout=120)
    assert res.returncode == 7, res.stdout + res.stderr
    err = res.stderr
    assert "ddlrun: rank 1 failed (exited with code 7); restart 1 of 2 (job " in err
    assert "ddlrun: rank 1 failed (exited with code 7); restart 2 of 2 (job " in err
    assert "ddlrun: rank 1 failed (exited with code 7); no restart left (--max-restarts 2 " \
        "used)" in err
    assert err.count("rank 1 on host localhost (pid ") == 3  # the report, each attempt
    assert f"job {job}.r2 ended with exit code 7" in err
    assert sorted(seen(tmp_path)) == [(a, r) for a in range(3) for r in range(2)]
    assert left_behind(job, f"{job}.r1", f"{job}.r2") == []
    assert wait_gone(marker) == []


def test_without_max_restarts_a_failure_ends_the_job_as_before(marker, tmp_path):
    job = f"r0_{marker[-8:]}"
    res = run_ddlrun("-n", "2", "--job-id", job, PY, SCRIPT, "always", marker,
                     str(tmp_path), "0", "9", timeout=120)
    assert res.returncode == 9, res.stderr
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("ddlrun:")]
    assert not [ln for ln in notes if "restart" in ln], notes
    assert f"job {job} ended with exit code 9" in res.stderr
    env = seen(tmp_path)
    assert sorted(env) == [(0, 0), (0, 1)]
    assert env[(0, 0)]["TORCHELASTIC_MAX_RESTARTS"] == "0"
    assert env[(0, 0)]["TORCHELASTIC_RUN_ID"] == job
    assert left_behind(job) == []
    assert wait_gone(marker) == []


def _wait_for(proc: subprocess.Popen, text: str, count: int) -> None:
    found = 0
    while found < count:
        line = proc.stdout.readline()
        assert line, "ddlrun ended early"
        found += text in line


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_a_restart_runs_stops_everything(marker, tmp_path, sig, code):
    job = f"rh_{marker[-8:]}"
    proc = subprocess.Popen(
        ddlrun_argv("-n", "2", "--max-restarts", "5", "--job-id", job, PY, SCRIPT, "hang",
                    marker, str(tmp_path), "0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(proc, "ready", 2)  # both ranks of restart 1
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == code, err
        assert "restart 1 of 5" in err and "restart 2" not in err
        assert "stopping all ranks" in err
        assert left_behind(job, f"{job}.r1") == []
        assert wait_gone(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_signal_during_the_teardown_of_a_failure_starts_no_restart(marker, tmp_path):
    job = f"rt_{marker[-8:]}"
    proc = subprocess.Popen(
        ddlrun_argv("-n", "2", "--max-restarts", "3", "--grace", "4", "--job-id", job, PY,
                    SCRIPT, "stubborn", marker, str(tmp_path), "1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while True:  # rank 1 failed; rank 0 ignores the SIGTERM: the teardown waits --grace
            line = proc.stderr.readline()
            assert line, "ddlrun ended early"
            if "exited with code 5; stopping the other ranks" in line:
                break
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 143, err
        assert "SIGTERM during the teardown: no restart" in err
        assert "restart 1 of" not in err
        assert sorted(seen(tmp_path)) == [(0, 0), (0, 1)]
        assert left_behind(job) == []
        assert wait_gone(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_timeout_counts_over_every_attempt(marker, tmp_path):
    t0 = time.monotonic()
    res = run_ddlrun("-n", "2", "--max-restarts", "50", "--timeout", "4", "--grace", "1",
                     PY, SCRIPT, "late", marker, str(tmp_path), "1", "7", timeout=120)
    took = time.monotonic() - t0
    assert res.returncode in (7, 124), res.stderr
    assert took < 20, f"took {took:.1f}s"
    assert "restart 50 of 50" not in res.stderr
    if res.returncode == 7:
        assert "--timeout 4s used up: no restart" in res.stderr
    assert wait_gone(marker) == []


def test_a_program_that_cannot_start_is_not_restarted():
    res = run_ddlrun("-n", "1", "--max-restarts", "3", "/nonexistent/prog", timeout=60)
    assert res.returncode == 127, res.stderr
    assert "/nonexistent/prog" in res.stderr and "restart" not in res.stderr


# ---------------------------------------------------------------------------- usage
@pytest.mark.parametrize("given", [["--max-restarts", "-1"], ["--max-restarts", "x"],
                                   ["--max-restarts", "1.5"], ["--max_restarts=-3"],
                                   ["--max-restarts", str(MAX_RESTARTS + 1)]])
def test_a_bad_max_restarts_is_one_usage_line_and_starts_nothing(tmp_path, given):
    made = tmp_path / "started"
    res = run_ddlrun("-n", "1", *given, PY, "-c", f"open({str(made)!r}, 'w')")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"ddlrun: error: --max-restarts must be a whole number from 0 to {MAX_RESTARTS}, "
        f"got {given[-1].partition('=')[2] or given[-1]!r}"]
    assert not made.exists()


@pytest.mark.parametrize("where,args", [
    ("--launcher ssh", ["-H", "node-a:2,node-b:2"]),
    ("--launcher mpirun", ["--launcher", "mpirun", "-n", "2"]),
    ("--launcher slurm", ["--launcher", "slurm", "-n", "2"]),
])
def test_restarts_are_refused_where_they_are_not_supported_yet(tmp_path, where, args):
    made = tmp_path / "started"
    res = run_ddlrun(*args, "--max-restarts", "2", PY, "-c", f"open({str(made)!r}, 'w')")
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        f"ddlrun: error: --max-restarts 2: restarts are not supported with {where} yet, only "
        "on one host or with one ddlrun per node (torchrun's way); drop --max-restarts"]
    assert not made.exists()
    # 0 is today's behaviour, accepted everywhere
    dry = run_ddlrun(*args, "--max-restarts", "0", "--dry-run", PY, "-c", "pass")
    assert dry.returncode == 0, dry.stderr


def test_a_job_id_too_long_for_the_restarts_ids_is_refused():
    res = run_ddlrun("-n", "1", "--max-restarts", "10", "--job-id", "j" * 61, "--dry-run",
                     PY, "-c", "pass")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"ddlrun: error: --job-id {'j' * 61!r} is too long for --max-restarts 10: the last "
        f"restart's job id {'j' * 61 + '.r10'!r} must fit 64 characters"]
    ok = run_ddlrun("-n", "1", "--max-restarts", "9", "--job-id", "j" * 61, "--dry-run",
                    PY, "-c", "pass")
    assert ok.returncode == 0, ok.stderr


def test_dry_run_shows_the_first_attempts_torchrun_variables():
    res = run_ddlrun("-n", "2", "--max-restarts", "3", "--job-id", "exp7", "--dry-run",
                     PY, "-c", "pass")
    assert res.returncode == 0, res.stderr
    common = next(ln for ln in res.stdout.splitlines() if ln.startswith("common env: "))
    for pair in ("TORCHELASTIC_MAX_RESTARTS=3", "TORCHELASTIC_RESTART_COUNT=0",
                 "TORCHELASTIC_RUN_ID=exp7", "DDL_JOB_ID=exp7"):
        assert pair in common.split(), common


# ---------------------------------------------------------------------------- pure parts
def _config(*argv: str) -> Config:
    return config_from_args(build_parser().parse_args(list(argv)), {})


def test_restart_inputs_are_a_new_job_of_the_same_run():
    cfg = _config("-n", "2", "--max-restarts", "2", "true")
    first = JobInputs("run1", 30000, {"DDL_JOB_SECRET": "s0"})
    again = restart_inputs(cfg, first, 2, {}, pick=lambda: 31000)
    assert (again.job_id, again.run_id, again.attempt) == ("run1.r2", "run1", 2)
    assert again.master_port == 31000
    assert again.secret_env.keys() == {"DDL_JOB_SECRET"}
    assert again.secret_env["DDL_JOB_SECRET"] != "s0"
    # the user's port and secret are theirs in every attempt
    cfg = _config("-n", "2", "--max-restarts", "2", "--master-port", "29600", "true")
    mine = restart_inputs(cfg, first, 1, {"DDL_JOB_SECRET": "mine"}, pick=lambda: 1 / 0)
    assert (mine.master_port, dict(mine.secret_env)) == (29600, {"DDL_JOB_SECRET": "mine"})
    assert attempt_job_id("run1", 0) == "run1"


def test_max_restarts_defaults_to_zero():
    assert _config("-n", "2", "true").max_restarts == 0
    assert _config("-n", "2", "--max_restarts", "4", "true").max_restarts == 4
    with pytest.raises(UsageError):
        _config("-n", "2", "--max-restarts", "-2", "true")


def test_the_example_goes_on_from_its_checkpoint_after_the_restart(tmp_path):
    script = str(HERE.parent.parent / "examples" / "elastic_restart.py")
    res = run_ddlrun("-n", "2", "--max-restarts", "2", PY, script, str(tmp_path),
                     "--crash-at", "5", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "RuntimeError: rank 1 crashes at step 5 (--crash-at)" in res.stderr
    assert "; restart 1 of 2 (job " in res.stderr
    report = json.loads(res.stdout.splitlines()[-1].partition("] ")[2])
    assert report["restart"] == 1
    assert report["starts"] == [[0, 0], [1, 5]]  # the second start began at step 5
    assert abs(report["w"] - 3.0) < 0.01
