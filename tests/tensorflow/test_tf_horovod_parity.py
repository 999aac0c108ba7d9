"""What Horovod's own test/parallel/test_tensorflow.py found missing in ddl.tensorflow,
fixed and kept fixed: each check runs on real ranks (workers/tf_parity.py), eagerly, in
a tf.function and in a TF1 graph session, 2 and 3 ranks in one job each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore", "DDL_TIMEOUT": "60",
       "KERAS_BACKEND": "tensorflow"}

pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]

EXPECTED = {"tape_process_set/eager", "tape_process_set/function", "tape_process_set/graph",
            "legacy/aggregation/dense", "legacy/aggregation/dense/global_step",
            "legacy/aggregation/sparse", "legacy/aggregation/sparse/global_step",
            "legacy/process_set", "refused/alltoall_rows/eager", "refused/not_member/eager",
            "refused/not_member/graph", "refused/unregistered/graph",
            "refused/unregistered/eager", "refused/in_step_after"}


def run_worker(n: int) -> list[dict]:
    cmd = [sys.executable, "-m", "ddlrun", "-n", str(n), sys.executable,
           os.path.join(HERE, "workers", "tf_parity.py")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, **ENV})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = [json.loads(line[line.index("{"):]) for line in p.stdout.splitlines()
           if '"failed"' in line]
    assert len(out) == n, p.stdout[-3000:] + p.stderr[-3000:]
    return sorted(out, key=lambda d: d["rank"])


@pytest.mark.parametrize("n", [2, 3])
def test_horovod_tensorflow_behaviours(n):
    for report in run_worker(n):
        assert report["failed"] == [], report["failed"][:5]
        assert set(report["checks"]) >= EXPECTED, sorted(EXPECTED - set(report["checks"]))
