"""ddl.tensorflow: eager GPU tensors are staged through host memory with both copies named
in the timeline (workers/tf_staging.py, 1 rank, the GPU placement simulated: see there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "tf_staging.py")
ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}


def test_gpu_tensors_are_staged_with_both_copies_in_the_timeline(tmp_path):
    trace = tmp_path / "t.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    p = subprocess.run([sys.executable, WORKER, str(trace)], capture_output=True, text=True,
                       timeout=180, env={**env, **ENV})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["found"] == {"gpu": "/job:localhost/replica:0/task:0/device:GPU:0",
                            "cpu": None}
    want = [[float(v) for v in range(r * 4, r * 4 + 4)] for r in range(3)]
    assert rep["plain"] == want and rep["staged"] == want and rep["gathered"] == [2, 3]
    files = list(tmp_path.glob("t*.json"))
    assert files, "no timeline written"
    doc = json.loads(files[0].read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    stages = [(e["name"], e["args"]["call"], e["args"]["bytes"]) for e in events
              if e.get("name", "").startswith("stage to ")]
    # the host tensor's call has none; the staged allreduce (48 B each way) and the
    # allgather (48 B in, 48 B out on 1 rank) have both copies, in order
    assert stages == [("stage to host", "staged", 48), ("stage to device", "staged", 48),
                      ("stage to host", "allgather", 48),
                      ("stage to device", "allgather", 48)], stages
