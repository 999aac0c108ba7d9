"""The library and ddlrun together: a SIGKILLed rank leaves no shared memory behind."""

import os
import subprocess
import sys

from .util import WORKERS


def test_ddlrun_removes_segments_of_a_killed_rank():
    job = f"cleanup{os.getpid()}"
    proc = subprocess.run(
        [sys.executable, "-m", "ddlrun", "-n", "3", "--job-id", job, sys.executable,
         os.path.join(WORKERS, "malloc_then_die.py")],
        capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 137, out  # 128 + SIGKILL, the first failure
    assert "heap" in out, "the job should have had heap segments to clean up"
    assert "rank 2" in out
    assert not [n for n in os.listdir("/dev/shm") if job in n]
