"""PyTorch Lightning, Hugging Face Accelerate and the Transformers ``Trainer`` on the ``ddl``
torch.distributed backend, under ddlrun with 2 ranks: each client's run on ``ddl`` ends with
the weights its run on ``gloo`` ends with, bit for bit (same seeds, same data), both ranks
agree, and what the client reduced across ranks (Lightning's ``sync_dist`` validation
metrics, Accelerate's ``gather_for_metrics``/``reduce``, the Trainer's evaluation) is right.

The workers are tests/torch/workers/client_*.py; each prints one JSON line per rank
(client_common.py says what is in it). Nothing reaches the network: models are built from
code or a config, data is synthetic, and the Hugging Face libraries run offline.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from torch_util import WORKERS, ddlrun

pytestmark = pytest.mark.slow

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "WANDB_DISABLED": "true", "WANDB_MODE": "disabled",
           "DISABLE_MLFLOW_INTEGRATION": "TRUE", "TOKENIZERS_PARALLELISM": "false"}
N = 2


def run_client(worker: str, backend: str) -> list[dict]:
    """One ddlrun job of ``worker`` on ``backend``: both ranks' reports, rank order."""
    proc = ddlrun(N, [os.path.join(WORKERS, worker), backend], timeout=170, env=OFFLINE)
    where = f"{worker} on {backend}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n" \
            f"{proc.stderr[-4000:]}"
    assert proc.returncode == 0, where
    lines = [ln.split("] ", 1)[-1] for ln in proc.stdout.splitlines()]
    reps = sorted((json.loads(ln) for ln in lines if ln.startswith('{"rank"')),
                  key=lambda r: r["rank"])
    assert [r["rank"] for r in reps] == list(range(N)), where
    return reps


def run_both(worker: str) -> dict[str, list[dict]]:
    """``worker`` on ddl and on gloo, checked for what every client must give: the backend
    asked for, trained weights identical on every rank, and ddl's bitwise equal to gloo's."""
    runs = {b: run_client(worker, b) for b in ("ddl", "gloo")}
    for backend, reps in runs.items():
        for r in reps:
            assert r["backend"] == backend and r["world"] == N, r
            assert r["digest"] != r["start"], f"{worker} on {backend}: weights never changed"
        assert len({r["digest"] for r in reps}) == 1, f"{worker} on {backend}: ranks differ"
        assert len({r["start"] for r in reps}) == 1, f"{worker}: seeds differ between ranks"
    assert runs["ddl"][0]["digest"] == runs["gloo"][0]["digest"], \
        f"{worker}: ddl's weights are not gloo's: {runs}"
    assert runs["ddl"][0]["steps"] == runs["gloo"][0]["steps"]
    return runs


def test_lightning_fit_validate_test_and_resume_with_sync_dist_on_ddl_equals_gloo():
    """fit, validate, test (sync_dist reductions of inference tensors, which the ddl backend
    updates in place from its worker thread), a checkpoint and a resumed fit."""
    pytest.importorskip("lightning")
    runs = run_both("client_lightning.py")
    for backend, reps in runs.items():
        for r in reps:
            assert r["strategy"] == "DDPStrategy" and r["pg_backend"] == backend
            assert r["fit_steps"] == 16  # 128 samples / 2 ranks / batch 8, 2 epochs
            assert r["steps"] == 24  # resumed at step 16 for a third epoch
            assert r["fit_digest"] not in (r["start"], r["digest"]), (backend, r)
            got, want = r["metrics"], r["expected"]
            # the mean of the per-rank means weighted by an int64 count (an integer AVG on
            # ddl, a SUM and a division on gloo): the whole validation set's loss
            assert math.isclose(got["val_loss"], want["val_loss"], rel_tol=1e-6), (backend, r)
            assert got["val_correct"] == want["val_correct"], (backend, r)  # int64, summed
            assert got["val_rank"] == want["val_rank"] == 0.5, (backend, r)  # int64, averaged
            assert math.isfinite(got["train_loss"])
            # validate() with the same weights logs what the fit's last validation did
            assert {k: r["validated"][k] for k in want} == {k: got[k] for k in want}, r
            t, wt = r["tested"], r["expected_test"]
            assert math.isclose(t["test_loss"], wt["test_loss"], rel_tol=1e-6), (backend, r)
            assert t["test_correct"] == wt["test_correct"], (backend, r)
            g, w = r["resumed_metrics"], r["expected_resumed"]
            assert math.isclose(g["val_loss"], w["val_loss"], rel_tol=1e-6), (backend, r)
            assert g["val_correct"] == w["val_correct"], (backend, r)
    ddl_run, gloo_run = runs["ddl"][0], runs["gloo"][0]
    for key in ("metrics", "validated", "tested", "resumed_metrics", "fit_digest"):
        assert ddl_run[key] == gloo_run[key], key


def test_accelerate_loop_on_a_ddl_process_group_made_first_equals_gloo():
    pytest.importorskip("accelerate")
    runs = run_both("client_accelerate.py")
    for reps in runs.values():
        for r in reps:
            assert r["distributed_type"] == "DistributedType.MULTI_CPU"
            assert r["num_processes"] == N
            assert r["steps"] == 12  # 96 samples / 2 ranks / batch 4 / 2 accumulated, 2 epochs
            assert r["val_seen"] == 40  # gather_for_metrics drops the sampler's padding
            assert r["mean_rank"] == 0.5
        assert reps[0]["val_correct"] == reps[1]["val_correct"]
    assert runs["ddl"][0]["val_correct"] == runs["gloo"][0]["val_correct"]


def test_transformers_trainer_on_a_ddl_process_group_made_first_equals_gloo():
    pytest.importorskip("transformers")
    runs = run_both("client_transformers.py")
    for reps in runs.values():
        for r in reps:
            assert r["parallel_mode"] == "ParallelMode.DISTRIBUTED" and r["world_size"] == N
            assert r["steps"] == 8
            assert len(r["losses"]) == 2 and r["losses"][1] < r["losses"][0], r  # it learns
            assert math.isclose(r["train_loss"], sum(r["losses"]) / 2, rel_tol=1e-6)
            assert math.isfinite(r["eval_loss"])
        assert reps[0]["eval_loss"] == reps[1]["eval_loss"]  # evaluation reduced over ranks
    ddl_run, gloo_run = runs["ddl"][0], runs["gloo"][0]
    assert (ddl_run["losses"], ddl_run["eval_loss"]) == (gloo_run["losses"], gloo_run["eval_loss"])
