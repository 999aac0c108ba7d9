"""ddl.tensorflow's collectives against numpy on 1, 2 and 4 ranks, eager and inside
tf.function, every dtype TF has, with Horovod's gradients (workers/tf_ops.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "tf_ops.py")
ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore", "DDL_TIMEOUT": "60"}
OPS = ("allreduce_sum", "allreduce_avg", "allreduce_max", "allreduce_min", "allgather",
       "broadcast", "grouped_allreduce", "reducescatter", "alltoall")
DTYPES = ("float16", "float32", "float64", "int32", "int64", "bfloat16")
GRADS = ("allreduce_sum", "allreduce_avg", "allgather", "broadcast", "reducescatter_sum",
         "grouped_allreduce", "alltoall")

pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]


def _run(n: int) -> list[dict]:
    cmd = [sys.executable, "-m", "ddlrun", "-n", str(n), sys.executable, WORKER]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, **ENV})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = []
    for line in p.stdout.splitlines():
        if '"failed"' in line:
            out.append(json.loads(line[line.index("{"):]))
    assert len(out) == n, p.stdout[-3000:]
    return sorted(out, key=lambda d: d["rank"])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_op_every_dtype_eager_and_in_tf_function(n):
    for report in _run(n):
        assert report["size"] == n
        ran = set(report["checks"])
        expected = {f"{op}/{mode}/{dt}" for op in OPS for mode in ("eager", "function")
                    for dt in DTYPES}
        expected |= {f"grad/{g}/{mode}" for g in GRADS for mode in ("eager", "function")}
        expected |= {"scalar/allreduce", "scalar/broadcast", "scalar/broadcast_variables",
                     "scalar/allgather", "tape/sparse_as_dense=False/emb",
                     "tape/sparse_as_dense=True/emb", "fp16/value", "broadcast_object",
                     "allgather_object", "mismatch/raised", "join/last", "join/sums",
                     "process_set/allreduce", "process_set/allgather"}
        assert expected <= ran, sorted(expected - ran)
        assert report["failed"] == [], report["failed"][:10]
