"""``ddl-perf train --framework keras``: the request checks and the document (no
TensorFlow in this process), the Keras models' parameter counts against the torch formulas
(in a process of their own), and real runs: 2-rank ddlrun jobs through ddl.keras's
DistributedOptimizer and through MultiWorkerMirroredStrategy, and a one-rank ResNet-50."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess

import pytest
from procs import PY, run_ddlrun

from ddl.perf import cli, models, scale, train, train_keras, train_result

# Not importorskip: importing TensorFlow here would cost every collecting run seconds.
if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None:
    pytest.skip("needs tensorflow and keras", allow_module_level=True)

pytestmark = pytest.mark.tensorflow

TINY_GPT = ["--framework", "keras", "--model", "gpt2", "--layers", "1", "--width", "64",
            "--heads", "2", "--seq-len", "16", "--vocab", "128"]
FEW = ["--steps", "2", "--warmup", "1", "--rounds", "1"]
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TF_CONFIG")}
ENV.update(OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore",
           DDL_TIMEOUT="60")

# Counted in a fresh process: the Keras GPT-2 at two shapes (each block and the whole
# model) and ResNet-50.
COUNT = """
import json, keras
from ddl.perf import models, train_keras
out = {}
for d, layers, vocab, seq in ((48, 2, 37, 10), (64, 1, 128, 16)):
    spec = models.ModelSpec("gpt2", width=d, layers=layers, heads=4, vocab=vocab, seq_len=seq)
    m = train_keras.build(keras, spec)
    out[str(d)] = {"total": m.count_params(), "block": m.blocks[0].count_params(),
                   "logits": list(m(keras.ops.zeros((2, seq), dtype="int32")).shape)}
r = train_keras.build(keras, models.ModelSpec("resnet50", image_size=32))
out["resnet50"] = {"total": r.count_params(),
                   "trainable": sum(int(v.numpy().size) for v in r.trainable_variables)}
print(json.dumps(out))
"""


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["train", *argv])


def _job(tmp_path, n: int, *argv: str) -> tuple[dict, str]:
    out = tmp_path / "t.json"
    res = run_ddlrun("-n", str(n), "--no-tag-output", "--timeout", "280", PY, "-m",
                     "ddl.perf.cli", "train", *argv, "--json", str(out), timeout=300,
                     env=ENV, cwd=tmp_path)
    assert res.returncode == 0, f"exit {res.returncode}:\n{res.stdout}{res.stderr[-4000:]}"
    return json.loads(out.read_text()), res.stdout


# ------------------------------------------------------------- requests, documents
def test_keras_requests_that_cannot_run_are_refused_with_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--via ddp is a PyTorch exchange"):
        train.config_from_args(_args(*TINY_GPT, "--via", "ddp"))
    with pytest.raises(ValueError, match="--via mwms is a Keras exchange: add --framework"):
        train.config_from_args(_args("--via", "mwms"))
    with pytest.raises(ValueError, match="ResNet50 has no stem width knob"):
        train.config_from_args(_args("--framework", "keras", "--width", "16"))
    with pytest.raises(ValueError, match="synthetic data only"):
        train.config_from_args(_args("--framework", "keras", "--data", str(tmp_path)))
    res = subprocess.run([PY, "-m", "ddl.perf.cli", "train", "--framework", "keras", "--via",
                          "ddp-gloo"], capture_output=True, text=True, env=ENV, timeout=60)
    assert res.returncode == 2 and "with --framework keras choose one of optimizer, mwms, " \
        "alone" in res.stderr


def test_keras_configs_pass_and_survive_scales_forwarded_argv():
    for via in train_keras.VIAS:
        for precision in ("fp32", "bf16", "amp"):
            cfg = train.config_from_args(_args(*TINY_GPT, "--via", via, "--precision",
                                               precision))
            assert cfg.framework == "keras" and cfg.via == via
    cfg = train.config_from_args(_args("--framework", "keras", "--width", "64"))
    assert cfg.model.name == "resnet50" and cfg.framework == "keras"
    args = _args(*TINY_GPT, "--via", "mwms")
    argv = train.train_argv(args)  # what `ddl-perf scale` gives each job
    assert argv[:2] == ["--framework", "keras"] and "--via" in argv
    assert train.config_from_args(_args(*argv)) == train.config_from_args(args)
    assert train.config_from_args(_args()).framework == "torch"  # never chosen for you
    assert scale.job_argv(2, argv, "/x.json")[-2:] == ["--json", "/x.json"]


def test_keras_document_names_the_framework_and_its_exchange():
    cfg = train.TrainConfig(model=models.ModelSpec("gpt2", width=64, heads=2, layers=1,
                                                   seq_len=16, vocab=128),
                            batch=8, via="mwms", framework="keras")
    times = [train.RankTimes(rank=r, step=0.04, input=0.0, compute=0.03) for r in range(2)]
    doc = train.summarize(cfg, times, params=59_000, data_desc="synthetic", device="cpu")
    assert doc["framework"] == "keras" and doc["how"] == train_result.KERAS_HOW
    assert doc["throughput"]["total"] == pytest.approx(2 * 8 * 16 / 0.04)
    text = train.format_result(doc)
    assert "via mwms (tf.distribute.MultiWorkerMirroredStrategy (RING)" in text
    torch_doc = train.summarize(dataclasses.replace(cfg, via="ddp", framework="torch"),
                                times, params=1, data_desc="synthetic", device="cpu")
    assert torch_doc["framework"] == "torch" and "DistributedDataParallel on the ddl " \
        "backend" in train.format_result(torch_doc)


# ------------------------------------------------------------------- the models
@pytest.mark.slow
def test_keras_models_have_the_torch_parameter_counts():
    res = subprocess.run([PY, "-c", COUNT], capture_output=True, text=True, env=ENV,
                         timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for d, layers, vocab, seq in ((48, 2, 37, 10), (64, 1, 128, 16)):
        assert got[str(d)]["block"] == models.gpt2_block_params(d)  # 12 d^2 + 13 d
        assert got[str(d)]["total"] == models.gpt2_params(d, layers, vocab, seq)
        assert got[str(d)]["logits"] == [2, seq, vocab]
    # 25,557,032 torch weights + 26,560 conv biases (trainable) + 53,120 batch-norm
    # moving means and variances (torch's buffers)
    assert got["resnet50"]["total"] == train_keras.RESNET50_PARAMS == 25_557_032 + 79_680
    assert got["resnet50"]["trainable"] == 25_557_032 + 26_560
    pytest.importorskip("torch")  # and the torch model itself, where installed
    net = models.build(models.ModelSpec("gpt2", width=48, layers=2, heads=4, vocab=37,
                                        seq_len=10))
    assert models.count_params(net) == got["48"]["total"]


# ------------------------------------------------------------------- real runs
@pytest.mark.slow
@pytest.mark.parametrize("via", ["optimizer", "mwms"])
def test_two_rank_keras_job_reports_every_rank_and_the_total(tmp_path, via):
    doc, stdout = _job(tmp_path, 2, *TINY_GPT, *FEW, "--via", via)
    assert doc["framework"] == "keras" and doc["via"] == via and doc["ranks"] == 2
    assert [r["rank"] for r in doc["per_rank"]] == [0, 1]
    assert doc["params"] == models.gpt2_params(64, 1, 128, 16)
    assert doc["unit"] == "tokens" and doc["throughput"]["total"] > 0
    assert doc["throughput"]["total"] == pytest.approx(
        sum(8 * 16 / r["step_s"] for r in doc["per_rank"]))
    assert sum(doc["shares"].values()) == pytest.approx(1.0)
    for r in doc["per_rank"]:
        assert sum(r["shares"].values()) == pytest.approx(1.0) and r["compute_s"] > 0
    assert "Keras 3" in doc["device"] and "tokens/s over 2 rank(s)" in stdout


@pytest.mark.slow
def test_one_rank_keras_resnet50(tmp_path):
    doc, stdout = _job(tmp_path, 1, "--framework", "keras", "--model", "resnet50",
                       "--image-size", "32", "--batch", "2", "--steps", "1", "--warmup", "0",
                       "--rounds", "1", "--via", "alone")
    assert doc["framework"] == "keras" and doc["ranks"] == 1 and doc["unit"] == "images"
    assert doc["params"] == train_keras.RESNET50_PARAMS
    assert doc["throughput"]["total"] == pytest.approx(2 / doc["step_s"])
    assert sum(doc["shares"].values()) == pytest.approx(1.0)
    assert "resnet50 (32x32 images), 25.637 M parameters" in stdout
