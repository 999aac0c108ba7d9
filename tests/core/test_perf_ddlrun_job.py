"""ddl-perf's own ddlrun jobs (``--ranks``, ``scale``): the deadline holds even when the job
prints nothing, and ddlrun's own teardown is what stops an overrunning job."""
import os
import subprocess
import sys
import time

import pytest

from ddl.perf.ddlrun_job import TIMEOUT_EXIT, ddlrun_argv, stream


def test_ddlrun_gets_the_deadline_itself():
    argv = ddlrun_argv(3, ["allreduce", "-b", "8"], 90.0, ["--launcher", "mpirun"])
    assert argv[1:] == ["-m", "ddlrun", "-n", "3", "--no-tag-output", "--timeout", "90",
                        "--launcher", "mpirun", sys.executable, "-m", "ddl.perf.cli",
                        "allreduce", "-b", "8"]


def test_lines_and_exit_code_pass_through():
    seen: list[str] = []
    code = stream([sys.executable, "-c", "print('a'); print('b'); raise SystemExit(3)"], 30,
                  seen.append)
    assert (code, seen) == (3, ["a\n", "b\n"])


@pytest.mark.parametrize("ignore_term", [False, True])
def test_a_silent_job_past_its_deadline_is_stopped(ignore_term):
    # what used to hang: the old loop read stdout to its end before the deadline applied
    prog = ("import signal, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + "time.sleep(120)\n")
    procs: list[subprocess.Popen] = []

    def start(*a, **k):
        procs.append(subprocess.Popen(*a, **k))
        return procs[-1]

    t = time.monotonic()
    code = stream([sys.executable, "-c", prog], 0.2, lambda _: None, start=start,
                  teardown=0.3, kill_after=0.5)
    took = time.monotonic() - t
    assert code == TIMEOUT_EXIT and took < 10, (code, took)
    assert procs[0].returncode == (-9 if ignore_term else -15)


@pytest.mark.slow
def test_ranks_job_past_its_timeout_is_torn_down_by_ddlrun():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DDL_JOB_ID", "OMPI_COMM_WORLD_SIZE")}
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ddl.perf.cli", "allreduce", "--ranks", "2",
                           "--timeout", "3", "-b", "16M", "-e", "16M", "-n", "1000000", "-w", "1"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == TIMEOUT_EXIT, proc.stderr
    assert time.monotonic() - t < 60
    assert "ddlrun: --timeout 3s reached; ranks still running: 0" in proc.stderr
    job = proc.stderr.split("ddlrun: job ", 1)[1].split()[0]
    assert not [f for f in os.listdir("/dev/shm") if job in f]  # ddlrun removed its segments
