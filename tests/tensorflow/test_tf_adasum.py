"""ddl.tensorflow's allreduce(op=hvd.Adasum) on 2 ranks against a numpy reference
(workers/tf_adasum.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "tf_adasum.py")
ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore", "DDL_TIMEOUT": "60"}

pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


@pytest.mark.timeout(400)
def test_tf_allreduce_adasum_matches_the_reference_on_two_ranks():
    cmd = [sys.executable, "-m", "ddlrun", "-n", "2", sys.executable, WORKER]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=360,
                       env={**os.environ, **ENV})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    reps = [json.loads(line[line.index("{"):]) for line in p.stdout.splitlines()
            if '"checks"' in line]
    assert sorted(r["rank"] for r in reps) == [0, 1], p.stdout[-3000:]
    for rep in reps:
        assert rep["checks"] == {
            "eager_float32": True, "graph_float32": True, "eager_float64": True,
            "graph_float64": True, "gradient": True, "integer_error": True}, rep
