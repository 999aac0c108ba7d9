"""Horovod-compatibility of ddl.tensorflow and ddl.keras on 2 real ranks
(workers/tf_compat.py): rank_op and kin, broadcast_, broadcast_global_variables,
broadcast_variables of Keras 3 variables in tf.function, local sources/variables, and
Horovod's error types."""

from __future__ import annotations

import functools
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


def run_worker(name: str, n: int = 2, env: dict | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "ddlrun", "-n", str(n), sys.executable,
           os.path.join(HERE, "workers", name)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, **ENV, **(env or {})})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = [json.loads(line[line.index("{"):]) for line in p.stdout.splitlines()
           if '"failed"' in line]
    assert len(out) == n, p.stdout[-3000:] + p.stderr[-3000:]
    return sorted(out, key=lambda d: d["rank"])


EXPECTED = {
    "rank_op/eager", "rank_op/function", "size_op/eager", "size_op/function",
    "local_rank_op/eager", "local_rank_op/function", "local_size_op/eager",
    "local_size_op/function", "process_set_included_op/eager",
    "process_set_included_op/function", "process_set_included_op/unknown/eager",
    "size_op/process_set", "process_sets/ids_and_ranks", "process_set_included_op/process_set",
    "broadcast_/eager/variable", "broadcast_/eager/returned", "broadcast_/function/variable",
    "broadcast_/function/returned", "broadcast_/single", "broadcast_global_variables/eager",
    "broadcast_variables/function/keras", "broadcast_variables/function/tf.Variable",
    "broadcast_variables/eager/keras", "broadcast_variables/eager/tf.Variable",
    "register_local_source/eager/shared", "register_local_source/eager/local",
    "register_local_source/function/shared", "register_local_source/function/local",
    "PartialDistributedGradientTape/bad_layers",
    "register_local_var/eager/shared", "register_local_var/eager/local",
    "register_local_var/function/shared", "register_local_var/function/local",
    "BroadcastGlobalVariablesCallback/local_variables/kept",
    "BroadcastGlobalVariablesCallback/local_variables/shared",
    "BroadcastGlobalVariablesCallback/local_variables/bad",
    "error/allreduce/shape", "error/allreduce/dtype", "error/allgather/rank",
    "error/broadcast/root", "error/broadcast_variables/shape", "error/function/shape",
    "error/function/message", "error/indexed_slices/Min", "error/indexed_slices/Max",
    "error/indexed_slices/prescale", "error/indexed_slices/postscale",
    "error/indexed_slices/grouped_prescale", "error/indexed_slices/function", "error/after",
}


def test_horovod_names_and_errors_on_two_ranks():
    for report in run_worker("tf_compat.py"):
        ran = set(report["checks"])
        assert report["failed"] == [], report["failed"][:10]
        assert ran >= EXPECTED, sorted(EXPECTED - ran)
        assert any(c.startswith("PartialDistributedGradientTape/") and c.endswith("/local")
                   for c in ran)
        assert any(c.startswith("PartialDistributedOptimizer/fit/") and c.endswith("/local")
                   for c in ran)
        assert report["failed"] == [], report["failed"][:10]


@functools.cache
def _graph_reports() -> list[dict]:
    return run_worker("tf_graph.py", env={"DDL_TIMEOUT": "30"})


def test_tf1_graph_collectives_carry_horovods_names_to_the_core():
    for report in _graph_reports():
        names = [c for c in report["failed"] if c[0].startswith("name")]
        assert names == [], names
        assert {"name/HorovodAllreduce_x_0", "name/tower/HorovodAllreduce_x_0", "name/given",
                "name/tower/HorovodAllgather_y_0", "name/HorovodBroadcast_y_0",
                "name/HorovodGroupedAllreduce_x_0_y_0", "name/mine"} <= set(report["checks"])


def test_tf1_graph_mismatches_raise_horovods_failed_precondition_and_stay_in_step():
    for report in _graph_reports():
        errors = [c for c in report["failed"] if c[0].startswith("error")]
        assert errors == [], errors
        want = {"allreduce/shape", "allreduce/dtype", "allgather/rank", "broadcast/root",
                "alltoall/dtype", "grouped/shape"}
        assert {f"error/{w}" for w in want} | {f"error/{w}/after" for w in want} \
            <= set(report["checks"])


def test_tf1_graph_independent_allreduces_in_one_session_run():
    """8 same-shape allreduces with no order between them, run by a 16-thread session in
    another order on each rank: each must meet its namesake, 3 runs in a row."""
    for report in _graph_reports():
        assert {"independent/0", "independent/1", "independent/2"} <= set(report["checks"])
        assert report["failed"] == [], report["failed"][:4]


@pytest.mark.parametrize("n", [2, 3])
def test_sync_batch_normalization_equals_one_batch_norm_over_every_ranks_rows(n):
    """Uneven batches (rank r has r + 1 rows), eager and tf.function, 2-D, 4-D, masked:
    output, input gradient and moving statistics as one BatchNormalization of all rows."""
    for report in run_worker("tf_sync_bn.py", n=n):
        assert report["failed"] == [], report["failed"][:6]
        ran = set(report["checks"])
        for how in ("eager", "function"):
            assert f"offset/{how}/output" in ran
            for case in ("2d", "2d_axis1", "nhwc", "masked"):
                assert {f"{case}/{how}/output/1", f"{case}/{how}/input_gradient/1",
                        f"{case}/{how}/moving_mean", f"{case}/{how}/moving_variance",
                        f"{case}/{how}/inference"} <= ran, sorted(ran)
        assert {"fused=True", "fused=None", "name", "two_in_one_model", "from_config"} <= ran
