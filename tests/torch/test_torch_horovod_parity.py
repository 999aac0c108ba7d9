"""Horovod's semantics that its own test_torch.py found ddl missing (benchmarks/horovod_tests.py
runs that file), checked on 2 real ranks: where the DistributedOptimizers give parameters a
``.grad`` (Adasum: zeros at construction; plain: only at ``step()``, zeros for a gradient this
rank did not compute), the earlier ``sparse=`` keyword its test_sparse_embeddings passes;
and that runner itself, on a small file of our own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from torch_util import ENV, ROOT, reports, run_worker


def test_optimizer_grads_and_keywords_as_horovod():
    reps = reports(run_worker("hvd_parity.py", 2))
    for rep in reps:
        assert rep["adasum_class"] == "DistributedAdasumOptimizer", rep
        # [shape, same dtype, sum of |grad|, requires_grad]: zeros, even where a gradient was
        assert rep["adasum_grads"] == {"0.weight": [[2, 3], True, 0.0, False],
                                       "0.bias": [[2], True, 0.0, False],
                                       "1.weight": [[1, 2], True, 0.0, False],
                                       "1.bias": None}, rep
        assert rep["plain_grads"] == {"0.weight": True, "0.bias": True, "1.weight": True,
                                      "1.bias": True}, rep
    # the layer rank 0 did not use: both ranks hold the average of zeros and rank 1's grad
    assert reps[0]["unused_on_rank0"] == reps[1]["unused_on_rank0"]
    assert any(v != 0 for v in reps[0]["unused_on_rank0"][0])
    # sparse=True: the rows either rank looked up (0, 1, 4) moved, the same on both ranks
    assert reps[0]["sparse_rows"] == reps[1]["sparse_rows"]
    assert reps[0]["sparse_changed"] == [0, 1, 4], reps[0]


# A Horovod-style test file of our own, for benchmarks/horovod_tests.py (the runner that
# measures Horovod's own files): one test passes, one fails on rank 0 only, one skips.
HVD_STYLE_FILE = '''
import unittest

import torch

import horovod.torch as hvd
from common import mpi_env_rank_and_size, skip_or_fail_gpu_test, temppath


class Tests(unittest.TestCase):
    def test_a_sum(self):
        hvd.init()
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2
        assert mpi_env_rank_and_size() == (0, 1)
        with temppath() as path:
            assert not os.path.exists(path)

    def test_b_fails_on_rank0(self):
        hvd.init()
        assert hvd.rank() != 0

    def test_c_skips(self):
        skip_or_fail_gpu_test(self, "no GPU here")


import os  # noqa: E402 - used by test_a_sum
'''


def test_horovod_test_runner(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "horovod_tests.py")
    test_file = tmp_path / "test_hvd_style.py"
    test_file.write_text(HVD_STYLE_FILE)
    for mode in ("--isolated", "--one-job"):
        out = tmp_path / f"{mode[2:]}.json"
        done = subprocess.run(
            [sys.executable, script, str(test_file), "--alias", "horovod.torch=ddl.torch",
             "-n", "2", mode, "--timeout", "120", "--workdir", str(tmp_path / mode[2:]),
             "--json", str(out)],
            capture_output=True, text=True, timeout=300, env={**os.environ, **ENV})
        assert done.returncode == 1, done.stdout + done.stderr  # a test failed
        results = {k.rsplit("::", 1)[-1]: v for k, v in json.loads(out.read_text()).items()}
        assert results["test_a_sum"]["overall"] == "passed", (mode, results)
        assert results["test_b_fails_on_rank0"]["per_rank"] == {"0": "failed", "1": "passed"}
        assert "assert" in results["test_b_fails_on_rank0"]["reasons"]["0"]
        assert results["test_c_skips"]["overall"] == "skipped", (mode, results)
        assert "overall" in done.stdout and "test_b_fails_on_rank0" in done.stdout
