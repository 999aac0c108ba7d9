"""ddl-perf train / scale / plot: the pure parts (models against their parameter formulas,
shares and efficiency arithmetic, the result documents, which kind a JSON file is), then
real runs: a 2-rank ddlrun job, --data on .npy files and images, scale --ranks 1,2 with its
table, JSON and PNG, and plot from a real allreduce --json."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddl.perf import cli, models, plot, scale, train, train_data

torch = pytest.importorskip("torch")
try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False
needs_mpl = pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")

TINY_GPT = ["--model", "gpt2", "--layers", "1", "--width", "32", "--heads", "2",
            "--seq-len", "16", "--vocab", "100", "--batch", "4"]
TINY_RESNET = ["--model", "resnet50", "--width", "8", "--image-size", "32", "--batch", "4"]
FEW = ["--steps", "3", "--warmup", "1", "--rounds", "1"]
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
# the older side-by-side comparison of DDP and the DistributedOptimizer: a benchmark script
SIDE_BY_SIDE = Path(__file__).resolve().parents[2] / "benchmarks" / "train_side_by_side.py"
_spec = importlib.util.spec_from_file_location("train_side_by_side", SIDE_BY_SIDE)
side_by_side = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(side_by_side)
ENV.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _run(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                         env=ENV)
    assert res.returncode == 0, f"{argv} exited {res.returncode}:\n{res.stdout}{res.stderr}"
    return res


def _perf(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddl.perf.cli", *args]


def _ddlrun(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "ddlrun", "-n", str(n), "--no-tag-output", "--timeout",
            "100", *_perf(*args)]


def _train_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["train", *argv])


def _doc(ranks: int, step_s: float, unit: str = "images") -> dict:
    cfg = train.TrainConfig(model=models.ModelSpec("resnet50"), batch=8)
    times = [train.RankTimes(rank=r, step=step_s, input=0.1 * step_s, compute=0.6 * step_s)
             for r in range(ranks)]
    return train.summarize(cfg, times, params=123, data_desc="synthetic", device="cpu")


# ----------------------------------------------------------------------- models
def test_resnet50_has_torchvisions_parameter_count_and_shapes():
    net = models.build(models.ModelSpec("resnet50"))
    assert models.count_params(net) == 25_557_032
    small = models.ModelSpec("resnet50", image_size=32, width=8, classes=10)
    x, y = models.synthetic_batch(small, 2, seed=0)
    assert x.shape == (2, 3, 32, 32) and y.shape == (2,) and int(y.max()) < 10
    out = models.build(small)(x)
    assert out.shape == (2, 10)
    assert small.unit == "images" and small.units_per_sample == 1


def test_gpt2_block_and_model_match_the_formulas():
    assert models.gpt2_block_params(768) == 12 * 768**2 + 13 * 768 == 7_087_872
    # GPT-2 small's published 124.44 M: 12 blocks, 50257 x 768 tokens, 1024 x 768 positions
    assert models.gpt2_params(768, 12, 50257, 1024) == 124_439_808
    one = models.build(models.ModelSpec("gpt2", layers=1, vocab=10, seq_len=8))
    blocks = sum(p.numel() for n, p in one.named_parameters() if n.startswith("blocks."))
    assert blocks == 7_087_872  # one block at width 768, counted from the module
    assert models.count_params(one) == models.gpt2_params(768, 1, 10, 8)
    spec = models.ModelSpec("gpt2", layers=2, width=48, heads=4, seq_len=10, vocab=37)
    net = models.build(spec)
    assert models.count_params(net) == models.gpt2_params(48, 2, 37, 10)
    x, y = models.synthetic_batch(spec, 3, seed=1)
    assert x.shape == y.shape == (3, 10) and torch.equal(x[:, 1:], y[:, :-1])
    assert net(x).shape == (3, 10, 37)
    assert spec.unit == "tokens" and spec.units_per_sample == 10


def test_model_specs_refuse_bad_shapes_with_the_flag():
    with pytest.raises(ValueError, match="--width 50 is not a multiple of --heads 4"):
        models.ModelSpec("gpt2", width=50, heads=4).validate()
    with pytest.raises(ValueError, match="--image-size 16"):
        models.ModelSpec("resnet50", image_size=16).validate()
    with pytest.raises(ValueError, match="choose one of resnet50, gpt2"):
        models.ModelSpec("vgg").validate()


# ------------------------------------------------------------ arithmetic, documents
def test_shares_add_up_and_never_go_negative():
    s = train.shares(step=1.0, input_s=0.1, compute=0.6)
    assert s == pytest.approx({"compute": 0.6, "comm": 0.3, "input": 0.1})
    # a compute-only step a little slower than the real one: no comm, still sums to 1
    s = train.shares(step=1.0, input_s=0.2, compute=1.1)
    assert s == pytest.approx({"compute": 0.8, "comm": 0.0, "input": 0.2})
    with pytest.raises(ValueError, match="must be > 0"):
        train.shares(0.0, 0.0, 0.0)


def test_scaling_efficiency_is_against_n_times_the_base():
    assert scale.efficiency([(1, 100.0), (2, 180.0), (4, 300.0)]) == pytest.approx(
        [1.0, 0.9, 0.75])
    # without a 1-rank point the smallest count is the base
    assert scale.efficiency([(2, 200.0), (4, 360.0)]) == pytest.approx([1.0, 0.9])
    with pytest.raises(ValueError, match="must be > 0"):
        scale.efficiency([(1, 0.0)])


def test_train_document_holds_per_rank_and_total_throughput():
    doc = _doc(ranks=2, step_s=0.5)
    assert doc["kind"] == "train" and doc["unit"] == "images" and doc["ranks"] == 2
    assert [r["throughput"] for r in doc["per_rank"]] == pytest.approx([16.0, 16.0])
    assert doc["throughput"] == pytest.approx({"total": 32.0, "per_rank": 16.0})
    assert doc["shares"] == pytest.approx({"compute": 0.6, "comm": 0.3, "input": 0.1})
    text = train.format_result(doc)
    assert "total 32.0 images/s over 2 rank(s), 16.0 per rank" in text
    assert "# how: step = median wall time" in text and "exposed communication" in text
    json.loads(json.dumps(doc))  # plain JSON all the way down


def test_scale_document_and_table():
    from rich.console import Console

    doc = scale.scale_doc([_doc(2, 0.6), _doc(1, 0.5)], ["--model", "resnet50"])
    assert [p["ranks"] for p in doc["points"]] == [1, 2]
    # 8 images per rank per step: 16/s at 1 rank (0.5 s), 2 x 8 / 0.6 at 2 ranks
    assert [p["throughput"] for p in doc["points"]] == pytest.approx([16.0, 2 * 8 / 0.6])
    assert [p["efficiency"] for p in doc["points"]] == pytest.approx([1.0, (16 / 0.6) / 32])
    assert plot.kind_of(doc) == plot.SCALE
    console = Console(width=120, record=True)
    console.print(scale.table(doc))
    text = console.export_text()
    assert "efficiency" in text and "83.3%" in text and "100.0%" in text


def test_side_by_side_table_splits_ddps_own_copies_from_its_communication():
    ms = {"compute": 25, "ddp-nocomm": 41, "ddp-gloo": 80, "ddp-ddl": 46,
          "ddp-view-nocomm": 34, "ddp-ddl-view": 39, "hvd-ddl": 38.5}
    res = {"median_s": {k: v / 1e3 for k, v in ms.items()}
           | {k: 0.01 for k in side_by_side.COMM},
           "params": 10, "bytes": 40, "ranks": 2, "buckets": 4, "ddp_ddl_equals_gloo": True}
    rows = {ln.split()[0]: ln.split()[1:] for ln in side_by_side.format_table(res).splitlines()
            if ln.startswith("  ")}
    # step, exposed (step - compute), DDP's own (its no-comm twin - compute), comm (the rest)
    assert rows["ddp-ddl"][:4] == ["46.0", "21.0", "16.0", "5.0"]
    assert rows["ddp-ddl-view"][:4] == ["39.0", "14.0", "9.0", "5.0"]
    assert rows["ddp-gloo"][:4] == ["80.0", "55.0", "16.0", "39.0"]
    assert rows["ddp-nocomm"][:3] == ["41.0", "16.0", "16.0"]  # no comm cell
    assert rows["hvd-ddl"][:3] == ["38.5", "13.5", "13.5"]  # all of it is its exchange
    assert rows["compute"][0] == "25.0"
    # a result written before the no-comm modes existed still prints
    old = {**res, "median_s": {k: v for k, v in res["median_s"].items()
                               if "nocomm" not in k and "view" not in k}}
    assert "ddp-ddl" in side_by_side.format_table(old)


def test_train_flags_round_trip_through_the_forwarded_argv():
    args = _train_args(*TINY_GPT, "--via", "ddp", "--precision", "amp")
    argv = train.train_argv(args)
    assert "--json" not in argv and argv[:2] == ["--model", "gpt2"]
    again = _train_args(*argv)
    assert train.config_from_args(again) == train.config_from_args(args)
    assert scale.job_argv(2, argv, "/x.json")[3:6] == ["-n", "2", "--no-tag-output"]


def test_jobs_go_where_the_host_flags_say_with_ddlrun_or_horovodrun(tmp_path, monkeypatch):
    from ddl.perf import ddlrun_job

    p = cli.build_parser()
    args = p.parse_args(["scale", "--ranks", "2", "-H", "a:2,b:2", "--launcher-arg=--ssh-port=2222",
                         *TINY_GPT])
    launch = ddlrun_job.launch_from_args(args)
    argv = scale.job_argv(4, train.train_argv(args), "/x.json", 60, launch)
    ddlrun_part = argv[:argv.index("ddl.perf.cli") - 2]
    assert ddlrun_part[3:5] == ["-n", "4"] and ddlrun_part[-3:] == [
        "-H", "a:2,b:2", "--ssh-port=2222"]
    assert argv[argv.index("ddl.perf.cli") + 1:][:3] == ["train", "--model", "gpt2"]
    # Horovod's jobs: its venv's horovodrun and python, this ddl first on its PYTHONPATH
    venv = tmp_path / "hvd"
    (venv / "bin").mkdir(parents=True)
    args = p.parse_args(["scale", "--via", "horovod", "--horovod", str(venv), *TINY_GPT])
    launch = ddlrun_job.launch_from_args(args)
    with pytest.raises(ValueError, match="no horovodrun in --horovod"):
        launch.check()
    (venv / "bin" / "horovodrun").write_text("#!/bin/sh\n")
    (venv / "bin" / "horovodrun").chmod(0o755)
    launch.check()
    argv = scale.job_argv(2, train.train_argv(args), "/x.json", 60, launch)
    assert argv[:7] == [str(venv / "bin" / "horovodrun"), "-np", "2", "-H", "localhost:2",
                        "--gloo", str(venv / "bin" / "python")]
    assert "--via" in argv and argv[argv.index("--via") + 1] == "horovod"
    import ddl

    root = str(Path(ddl.__file__).resolve().parent.parent)
    assert launch.env()["PYTHONPATH"].split(os.pathsep)[0] == root
    with pytest.raises(ValueError, match="--horovod VENV is for --via horovod"):
        ddlrun_job.launch_from_args(p.parse_args(["scale", "--horovod", str(venv)])).check()
    # a Horovod that sees fewer ranks than were started is refused, not reported
    monkeypatch.setenv("HOROVOD_SIZE", "3")
    assert train._launched_size() == 3


def test_scale_gives_every_job_the_same_threads_per_rank():
    from ddl.perf.ddlrun_job import DDLRUN, Launch

    env = scale.same_threads([1, 2, 4], DDLRUN, {"PATH": "/bin"}, cores=8)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "2"}  # 8 cores // 4 ranks, at 1 too
    assert scale.same_threads([1, 2], DDLRUN, {}, cores=1)["OMP_NUM_THREADS"] == "1"
    assert scale.same_threads([1, 2], DDLRUN, {"OMP_NUM_THREADS": "3"}, cores=8) is None
    assert scale.same_threads([1, 2], Launch(hosts="a:2,b:2"), {}, cores=8) is None


def test_bad_train_requests_are_refused_with_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--steps 0: must be >= 1"):
        train.config_from_args(_train_args("--steps", "0"))
    with pytest.raises(ValueError, match="ddp-nccl needs CUDA"):
        train.config_from_args(_train_args("--via", "ddp-nccl", "--device", "cpu"))
    with pytest.raises(ValueError, match="not a directory"):
        train.config_from_args(_train_args("--data", str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="no .jpg, .jpeg, .png or .npy file"):
        train_data.scan_data(tmp_path, models.ModelSpec("resnet50"))
    res = subprocess.run(_perf("train", "--batch", "0"), capture_output=True, text=True,
                         env=ENV, timeout=60)
    assert res.returncode == 2 and "--batch 0: must be >= 1" in res.stderr


def test_plot_kinds_are_read_from_the_file():
    coll = {"version": 2, "tool": "ddl-perf", "collective": "allreduce", "results": []}
    assert plot.kind_of(coll) == plot.COLLECTIVE
    assert plot.kind_of([coll, coll]) == plot.COLLECTIVE  # --ranks 2,4 writes a list
    with pytest.raises(plot.PlotError, match="plot the output of `ddl-perf scale"):
        plot.kind_of(_doc(1, 0.5))
    with pytest.raises(plot.PlotError, match="not a ddl-perf result"):
        plot.kind_of({"results": []})


def test_busbw_series_labels_engines_and_rank_counts():
    def row(engine, ranks, size, bw):
        part = {"time": 1.0, "alg_bw": bw, "bus_bw": bw, "nwrong": 0}
        return {"engine": engine, "ranks": ranks, "size": size, "experiment_name": "allreduce",
                "out_of_place": part, "in_place": dict(part, bus_bw=bw / 2)}

    docs = [{"results": [row("ddl", 2, 64, 1.0), row("gloo", 2, 64, 0.5),
                         row("ddl", 2, 16, 0.2)]},
            {"results": [row("ddl", 4, 16, 0.1)]}]
    got = plot.busbw_series(docs)
    assert got == {"ddl (2 ranks)": [(16, 0.2), (64, 1.0)], "gloo (2 ranks)": [(64, 0.5)],
                   "ddl (4 ranks)": [(16, 0.1)]}
    assert plot.busbw_series(docs[:1], in_place=True)["ddl"] == [(16, 0.1), (64, 0.5)]


def _profile_doc() -> dict:
    """A calibrate profile: two dimensions, their measured rows, and whole calls."""
    from ddl import cost

    shm, net = cost.Link(2e-4, 1 / 3e9), cost.Link(1e-3, 1 / 6e7)
    measured = [{"dim": d, "engine": e, "size": 2, "algorithm": a, "bytes": b,
                 "seconds": cost.allreduce_time(a, 2, b, lk) * f}
                for d, e, a, lk in ((0, "shm", "shm", shm), (1, "gloo", "native", net))
                for b, f in ((16384, 1.1), (1 << 20, 0.9))]
    measured += [{"dim": "call", "bytes": b, "seconds": 0.01} for b in (16384, 65536)]
    return {"version": 1, "machine": "m", "call_overhead_s": 0.004, "measured": measured,
            "dims": [{"index": i, "engine": e, "size": 2, "algorithm": a, "alpha_s": lk.alpha,
                      "beta_s_per_byte": lk.beta}
                     for i, (e, a, lk) in enumerate((("shm", "shm", shm),
                                                     ("gloo", "native", net)))]}


def test_predictions_are_drawn_against_measurements():
    """simulate --json against allreduce --json rows; a calibrate profile's fit against its
    own measured rows (the plot kinds 'simulate' and 'profile')."""
    from ddl import cost
    from ddl.perf import simulate

    links = [("shm", cost.SHARED_MEMORY), ("net", cost.NETWORK)]
    rows = [simulate.allreduce_row([2, 2], links, b, 8 << 20) for b in (4096, 1 << 20)]
    sim = {"tool": "ddl-perf", "kind": "simulate", "grid": [2, 2], "rows": rows}
    assert plot.kind_of(sim) == plot.SIMULATE
    got = plot.predicted_times(sim)
    assert got["predicted: ddl, grid 2x2"] == [(4096, rows[0]["pipelined_s"]),
                                               (1 << 20, rows[1]["pipelined_s"])]
    assert got["predicted: flat ring, 4 ranks"][1] == (1 << 20, rows[1]["flat_s"])

    def row(size, us):
        part = {"time": us, "alg_bw": 1.0, "bus_bw": 1.0, "nwrong": 0}
        return {"engine": "ddl", "ranks": 4, "size": size, "experiment_name": "allreduce",
                "out_of_place": part, "in_place": dict(part, time=us / 2)}

    coll = {"tool": "ddl-perf", "collective": "allreduce",
            "results": [row(1 << 20, 3000.0), row(4096, 500.0)]}
    assert plot.measured_times([coll]) == {"measured: ddl (4 ranks)": [(4096, 5e-4),
                                                                      (1 << 20, 3e-3)]}
    assert plot.measured_times([coll], in_place=True)["measured: ddl (4 ranks)"][0][1] == 2.5e-4

    doc = _profile_doc()
    assert plot.kind_of(doc) == plot.PROFILE
    series = plot.profile_series(doc)
    assert [label for label, _, _ in series] == ["dim 0 (shm, 2 ranks)", "dim 1 (gloo, 2 ranks)",
                                                 "whole call"]
    label, got_pts, model = series[1]
    assert [b for b, _ in got_pts] == [16384, 1 << 20]
    assert [m / g for (_, g), (_, m) in zip(got_pts, model)] == pytest.approx([1 / 1.1, 1 / 0.9])
    assert all(m > 0.004 for _, m in series[2][2])  # the whole call's model has the overhead
    with pytest.raises(plot.PlotError, match="call_overhead_s"):
        plot.profile_series(dict(doc, call_overhead_s="x"))


@needs_mpl
def test_plot_draws_predictions_and_a_profile(tmp_path):
    from ddl import cost
    from ddl.perf import simulate

    rows = [simulate.allreduce_row([2, 2], [("shm", cost.SHARED_MEMORY), ("net", cost.NETWORK)],
                                   b, 8 << 20) for b in (4096, 1 << 20)]
    (tmp_path / "sim.json").write_text(json.dumps(
        {"tool": "ddl-perf", "kind": "simulate", "grid": [2, 2], "rows": rows}))
    (tmp_path / "prof.json").write_text(json.dumps(_profile_doc()))
    plot.render([plot.load(str(tmp_path / n)) for n in ("sim.json", "prof.json")],
                str(tmp_path / "p.svg"))
    svg = (tmp_path / "p.svg").read_text()
    assert "allreduce, grid 2x2: predicted (lines)" in svg
    assert "fitted model (lines) vs measured (hollow markers)" in svg
    empty = dict(_profile_doc(), measured=[])
    (tmp_path / "empty.json").write_text(json.dumps(empty))
    with pytest.raises(plot.PlotError, match="no measured rows"):
        plot.render([plot.load(str(tmp_path / "empty.json"))], str(tmp_path / "e.png"))


@needs_mpl
def test_plot_draws_a_measured_scale_against_a_simulated_one(tmp_path):
    from ddl.perf.cli import main

    assert main(["simulate", "--preset", "powerai-2017", "--scaling", "weak", "--gpus", "8",
                 "--json", str(tmp_path / "sim.json")]) == 0
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert plot.kind_of(doc) == plot.SIM_SCALING
    scale = _doc(1, 0.5)
    scale = {**scale, "tool": "ddl-perf", "kind": "scale", "unit": "images",
             "points": [{"ranks": 1, "throughput": 16.0}, {"ranks": 2, "throughput": 24.0}]}
    assert plot.measured_efficiency(scale)[1:] == ([1, 2], [1.0, 0.75])
    (tmp_path / "scale.json").write_text(json.dumps(scale))
    plot.render([plot.load(str(tmp_path / n)) for n in ("sim.json", "scale.json")],
                str(tmp_path / "p.svg"))
    svg = (tmp_path / "p.svg").read_text()
    assert "predicted: DDL multi-dim, weak" in svg and "measured: resnet50" in svg


@pytest.mark.skipif(HAVE_MPL, reason="matplotlib is installed: its absence cannot be seen")
def test_without_matplotlib_plot_says_so_in_one_line():
    with pytest.raises(plot.PlotError, match="needs matplotlib"):
        plot._figure_cls()


# ------------------------------------------------------------------- real runs
@pytest.mark.slow
def test_two_rank_ddlrun_job_reports_every_rank_and_the_total(tmp_path):
    out = tmp_path / "t.json"
    res = _run(_ddlrun(2, "train", *TINY_GPT, *FEW, "--via", "ddp", "--json", str(out)),
               tmp_path)
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2 and [r["rank"] for r in doc["per_rank"]] == [0, 1]
    assert doc["via"] == "ddp" and doc["unit"] == "tokens"
    assert doc["params"] == models.gpt2_params(32, 1, 100, 16)
    assert doc["throughput"]["total"] == pytest.approx(
        sum(4 * 16 / r["step_s"] for r in doc["per_rank"]))
    assert sum(doc["shares"].values()) == pytest.approx(1.0)
    assert "tokens/s over 2 rank(s)" in res.stdout and "# how:" in res.stdout


@pytest.mark.slow
def test_side_by_side_comparison_runs_every_mode_with_buckets_moved(tmp_path):
    out = tmp_path / "side.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDL_TORCH_SHARE_BYTES": "64K"}
    res = subprocess.run([sys.executable, str(SIDE_BY_SIDE), "--ranks", "2", "--steps",
                          "3", "--warmup", "2", "--rounds", "1", "--width", "256",
                          "--comm-reps", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(side_by_side.MODES) | set(side_by_side.COMM) <= set(doc["median_s"])
    # both DDP bucket modes on ddl, their buckets moved into the heap, equal DDP on gloo
    assert doc["ddp_ddl_equals_gloo"] is True
    assert doc["ddp_buckets_in_heap"] >= 2  # one per DDP-on-ddl model at least, every rank
    assert "ddp-view-nocomm" in res.stdout and "DDP own ms" in res.stdout


@pytest.mark.slow
def test_data_dir_of_npy_arrays_and_images_is_read_with_a_dataloader(tmp_path):
    rng = np.random.default_rng(0)
    npy = tmp_path / "npy"
    for cls in ("a", "b"):
        (npy / cls).mkdir(parents=True)
        for i in range(4):
            np.save(npy / cls / f"{i}.npy", rng.integers(0, 255, (36, 36, 3), dtype=np.uint8))
    samples, what = train_data.scan_data(npy, models.ModelSpec("resnet50"))
    assert len(samples) == 8 and {c for _, c in samples} == {0, 1} and "2 class(es)" in what
    x, label = train_data.ImageData(samples, 32)[5]
    assert x.shape == (3, 32, 32) and label == 1 and 0.0 <= float(x.min()) <= 1.0
    out = tmp_path / "npy.json"
    _run(_perf("train", *TINY_RESNET, *FEW, "--data", str(npy), "--num-workers", "1",
               "--json", str(out)), tmp_path)
    doc = json.loads(out.read_text())
    assert "8 .npy files" in doc["data"] and "1 worker(s)" in doc["data"]
    assert doc["per_rank"][0]["input_s"] > 0 and doc["unit"] == "images"
    if train_data.image_library() is None:
        pytest.skip("no image library: --data reads .npy only")
    from PIL import Image

    img = tmp_path / "img"
    for cls, ext in (("cat", "jpg"), ("dog", "png")):
        (img / cls).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(
                img / cls / f"{i}.{ext}")
    samples, what = train_data.scan_data(img, models.ModelSpec("resnet50"))
    assert what.startswith("6 images (JPEG/PNG, decoded with PIL) in 2 class(es)")
    from torch.utils.data import DataLoader  # what train's loader does, without a job

    xs, labels = next(iter(DataLoader(train_data.ImageData(samples, 32), batch_size=6,
                                      num_workers=1)))
    assert xs.shape == (6, 3, 32, 32) and labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert float(xs.min()) >= 0.0 and float(xs.max()) <= 1.0


@pytest.mark.slow
def test_via_horovod_trains_with_the_horovod_module_it_imports(tmp_path):
    """--via horovod takes whatever ``horovod.torch`` imports: here ddl.torch under that
    name (Horovod itself is not installed; docs/performance.md has runs with the real one),
    so the Horovod path of the loop runs for real: its init, ranks, optimizer, barrier."""
    shim = tmp_path / "shim" / "horovod" / "torch"
    shim.mkdir(parents=True)
    (shim.parent / "__init__.py").write_text("")
    (shim / "__init__.py").write_text("from ddl.torch import *  # noqa: F403\n")
    out = tmp_path / "h.json"
    env = dict(ENV, HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",  # as horovodrun would
               PYTHONPATH=os.pathsep.join(filter(None, [str(shim.parent.parent),
                                                        ENV.get("PYTHONPATH")])))
    res = subprocess.run(_ddlrun(2, "train", *TINY_GPT, *FEW, "--via", "horovod", "--json",
                                 str(out)), capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(out.read_text())
    assert doc["via"] == "horovod" and doc["ranks"] == 2
    assert all(r["wait_s"] is not None for r in doc["per_rank"])
    res = subprocess.run(_ddlrun(2, "train", *TINY_GPT, *FEW, "--via", "horovod"),
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=dict(ENV, HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1"))
    assert res.returncode != 0 and "--via horovod: horovod.torch does not import" in (
        res.stdout + res.stderr)
    # a job horovodrun did not start: Horovod itself would wait 30 s for a store nobody
    # runs, then abort; refused at once instead
    env.pop("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    res = subprocess.run(_ddlrun(2, "train", *TINY_GPT, *FEW, "--via", "horovod"),
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 2 and "not started by horovodrun" in res.stderr, res.stderr


@pytest.mark.slow
@needs_mpl
def test_scale_runs_one_job_per_count_with_table_json_and_plot(tmp_path):
    res = _run(_perf("scale", "--ranks", "1,2", *TINY_GPT, *FEW, "--json", "s.json",
                     "--plot", "s.png"), tmp_path, timeout=200)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [p["ranks"] for p in doc["points"]] == [1, 2] and len(doc["runs"]) == 2
    assert doc["points"][0]["efficiency"] == pytest.approx(1.0)
    p1, p2 = doc["points"]
    assert p2["efficiency"] == pytest.approx(p2["throughput"] / (2 * p1["throughput"]))
    assert "efficiency" in res.stdout and "tokens/s" in res.stdout
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@needs_mpl
def test_plot_draws_a_real_allreduce_json_and_a_scale_json(tmp_path):
    _run(_perf("allreduce", "--ranks", "2", "-b", "1K", "-e", "64K", "-f", "8", "-n", "3",
               "-w", "1", "--compare", "gloo", "--json", "ar.json"), tmp_path)
    series = plot.busbw_series([json.loads((tmp_path / "ar.json").read_text())])
    assert set(series) == {"ddl", "gloo"} and [s for s, _ in series["ddl"]] == [1024, 8192,
                                                                                 65536]
    (tmp_path / "sc.json").write_text(json.dumps(
        scale.scale_doc([_doc(1, 0.5), _doc(2, 0.6)], [])))
    res = _run(_perf("plot", "ar.json", "sc.json", "-o", "both.svg"), tmp_path)
    assert "wrote both.svg" in res.stdout
    svg = (tmp_path / "both.svg").read_text()
    assert "allreduce, 2 ranks on" in svg and "ddl vs gloo" in svg
    assert "memory roofline, 2 ranks" in svg and "64 KiB" in svg
    bad = subprocess.run(_perf("plot", "sc.json", "-o", "x.jpg"), capture_output=True,
                         text=True, cwd=tmp_path, env=ENV, timeout=60)
    assert bad.returncode == 2 and "give a .png or .svg" in bad.stderr
