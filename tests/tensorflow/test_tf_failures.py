"""A rank killed while the other is inside a tf.function collective: the survivor fails
fast with ddl's message naming the dead rank, and ddlrun reports rank 1's exit code."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.tensorflow, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                 reason="tensorflow is not installed (the tensorflow extra)")]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "tf_killed.py")
ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "3", "DDL_TIMEOUT": "60"}


def test_a_killed_rank_fails_the_survivor_fast():
    p = subprocess.run([sys.executable, "-m", "ddlrun", "-n", "2", sys.executable, WORKER],
                       capture_output=True, text=True, timeout=240,
                       env={**os.environ, **ENV})
    out = p.stdout + p.stderr
    assert p.returncode == 7, out[-3000:]  # the first failure: rank 1's own exit code
    # ddlrun names rank 1 first (its summary line), not merely some rank's code 7
    assert re.search(r"^ddlrun: rank 1 on host \S+ \(pid \d+\) exited with code 7",
                     p.stderr, re.M), out[-3000:]
    assert "NO ERROR" not in out, out[-3000:]


def test_without_a_supervisor_the_survivor_raises_ddls_error():
    """No ddlrun to stop it: rank 0's tf.function allreduce must raise (a TF error carrying
    ddl's message naming rank 1) instead of waiting on a dead peer."""
    from ddl.perf.spawn import run_local

    res = run_local(2, [WORKER], env={**ENV, "DDL_TIMEOUT": "30"}, timeout=200)
    by_rank = {r.rank: r for r in res}
    assert by_rank[1].returncode == 7
    out0 = by_rank[0].stdout
    assert by_rank[0].returncode == 3 and "RAISED after" in out0, out0 + by_rank[0].stderr
    assert out0.strip().splitlines()[-1] == "True", out0  # ddl's text, naming rank 1
    seconds = float(re.search(r"RAISED after ([0-9.]+)s", out0)[1])
    assert seconds < 30, seconds  # the peer's death is seen, not the timeout
