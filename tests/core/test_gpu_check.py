"""ddl-perf gpu-check: the pure plan (checks, ranks, deadlines within the budget), the pure
report (markdown and JSON), how a job's output becomes a result (a crash, a hang, a pass
that exits non-zero), the one-line exit without a GPU, and the whole pipeline for real on
CPU ranks (--simulate-cpu: ddl's device engine over Gloo, torch's Gloo for its NCCL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddl.perf import gpu_check, gpu_check_plan, gpu_check_report
from ddl.perf.gpu_check_plan import Check, Job
from ddl.perf.gpu_check_report import Result

ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
ENV.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
NAMES = ["collectives", "allreduce", "ddp", "multidim", "set_device", "tensorflow", "train"]


def _perf(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300
          ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddl.perf.cli", "gpu-check", *args],
                          capture_output=True, text=True, cwd=cwd, env=env or ENV,
                          timeout=timeout)


# ----------------------------------------------------------------------- the plan
@pytest.mark.parametrize("gpus", range(1, 9))
def test_plan_fits_the_budget_with_one_rank_per_gpu(gpus):
    checks = gpu_check_plan.plan(gpus, "out")
    assert [c.name for c in checks] == NAMES
    assert gpu_check_plan.total_timeout(checks) <= gpu_check_plan.BUDGET_S < 8 * 60
    for c in checks:
        for job in c.jobs:
            # TF tensors never reach the device engine: "nccl" would refuse without torch
            engine = "host" if c.name == "tensorflow" else "nccl"
            assert dict(job.env)["DDL_DEVICE_ENGINE"] == engine
            assert "--simulate-cpu" not in job.args
            if c.name != "multidim":
                assert job.ranks == gpus
    run = {c.name: c for c in checks if not c.skip}
    assert "-g" in run["allreduce"].jobs[0].args
    assert run["allreduce"].jobs[0].args[run["allreduce"].jobs[0].args.index("-g") + 1] == "cuda"
    assert [j.args[j.args.index("--via") + 1] for j in run["train"].jobs] == ["ddp", "ddp-nccl"]
    assert all(j.json and j.json.startswith(os.path.join("out", "raw")) for j in
               run["train"].jobs + run["allreduce"].jobs)


@pytest.mark.parametrize("gpus,grid", [(1, None), (2, None), (3, None), (4, (2, 2)),
                                       (5, (2, 2)), (6, (2, 3)), (7, (2, 3)), (8, (2, 2, 2))])
def test_multidim_grid_per_gpu_count(gpus, grid):
    assert gpu_check_plan.grid_for(gpus) == grid
    multi = {c.name: c for c in gpu_check_plan.plan(gpus, "o")}["multidim"]
    if grid is None:
        assert multi.skip and not multi.jobs and "at least 4" in multi.skip
    else:
        shape = "x".join(map(str, grid))
        (job,) = multi.jobs
        assert dict(job.env)["DDL_OPTIONS"] == f"-mode n:{shape}"
        assert job.args[job.args.index("--grid") + 1] == shape
        assert job.ranks == __import__("math").prod(grid)


def test_one_gpu_says_what_cannot_be_checked():
    checks = gpu_check_plan.plan(1, "o")
    noted = [c.name for c in checks if "no device engine" in " ".join(c.notes)]
    assert noted == ["collectives", "allreduce", "ddp", "tensorflow", "train"]
    assert not any(c.notes for c in gpu_check_plan.plan(2, "o"))


def test_simulated_plan_runs_cpu_tensors_through_gloo():
    checks = gpu_check_plan.plan(2, "o", simulate=True)
    for c in checks:
        for job in c.jobs:
            assert dict(job.env)["DDL_DEVICE_ENGINE"] == (
                "host" if c.name == "tensorflow" else "gloo")
            if job.module == gpu_check_plan.WORKERS:
                assert "--simulate-cpu" in job.args
            else:
                assert "cuda" not in job.args and "nccl" not in " ".join(job.args)


def test_without_torch_only_tensorflow_runs():
    # the TensorFlow CUDA image has no torch: the torch checks are skipped, not failed
    checks = gpu_check_plan.plan(2, "o", torch=False)
    assert [c.name for c in checks] == NAMES
    assert [c.name for c in checks if not c.skip] == ["tensorflow"]
    assert all("torch is not installed" in c.skip for c in checks
               if c.skip and c.name != "multidim")


@pytest.mark.skipif(__import__("importlib").util.find_spec("tensorflow") is None,
                    reason="TensorFlow is not installed")
def test_without_torch_the_gpus_are_those_tensorflow_sees():
    # torch made unimportable, as in the TensorFlow image: TensorFlow is asked, so a GPU
    # machine running that image is not told "no CUDA GPU visible"
    code = ("import sys; sys.modules['torch'] = None\n"
            "from ddl.perf import gpu_check; print(gpu_check.visible_gpus())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(ENV, CUDA_VISIBLE_DEVICES=""), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "TensorFlow" in res.stdout.splitlines()[-1], res.stdout


def test_plan_only_and_bad_requests():
    assert [c.name for c in gpu_check_plan.plan(4, "o", only=("ddp", "train"))] == [
        "ddp", "train"]
    with pytest.raises(ValueError, match="--only nope: no such check"):
        gpu_check_plan.plan(2, "o", only=("nope",))
    with pytest.raises(ValueError, match="at least one"):
        gpu_check_plan.plan(0, "o")


# ---------------------------------------------------------------------- the report
RESULTS = [
    Result("collectives", "engine", "pass", "all right", 1.5, ("dtype", "engine"),
           (("float32", "nccl"),), ("sizes 1, 7",)),
    Result("ddp", "DDP", "fail", "job ddp timed out after 45 s", 45.0,
           tail=("line a", "line | b")),
    Result("multidim", "grid", "skip", "1 GPU(s): needs 4"),
]
META = {"host": "h", "gpus": "2 x H200"}


def test_markdown_has_the_verdict_the_table_and_a_section_per_check():
    md = gpu_check_report.render_markdown(RESULTS, META)
    lines = md.splitlines()
    assert lines[0] == "# ddl-perf gpu-check: FAILED"
    assert "- gpus: 2 x H200" in lines
    assert "- checks: 1 passed, 1 failed, 1 skipped" in lines
    assert "| ddp | FAIL | 45.0 | job ddp timed out after 45 s |" in lines
    assert "| float32 | nccl |" in lines
    assert "## multidim: SKIP" in lines
    # the failed job's last lines, verbatim in a code block
    at = lines.index("## ddp: FAIL")
    assert lines[at:].index("```") < lines[at:].index("line | b")
    assert gpu_check_report.exit_code(RESULTS) == 1
    assert gpu_check_report.exit_code([RESULTS[0], RESULTS[2]]) == 0


def test_json_twin_round_trips():
    text = gpu_check_report.to_json(RESULTS, META)
    doc = json.loads(text)
    assert doc["kind"] == "gpu-check" and doc["verdict"] == "FAILED"
    results, meta = gpu_check_report.from_json(text)
    assert results == RESULTS and meta == META
    with pytest.raises(ValueError, match="not a ddl-perf gpu-check report"):
        gpu_check_report.from_json('{"kind": "train"}')
    with pytest.raises(ValueError, match="status 'ok'"):
        Result("x", "x", "ok", "x")


# -------------------------------------------------- a job's output becomes a result
CHECK = Check("ddp", "DDP", (Job("ddp", 2, gpu_check_plan.WORKERS, ("ddp",), 45.0),))


def _outcome(code, result=None, tail=("last",)):
    return gpu_check.Outcome(CHECK.jobs[0], code, result, tail, 3.0)


def test_a_hang_a_crash_and_a_pass_that_exits_nonzero_are_failures():
    hang = gpu_check.result_of_worker(CHECK, _outcome(124))
    assert hang.status == "fail" and hang.summary == "job ddp timed out after 45 s"
    assert hang.tail == ("last",)
    crash = gpu_check.result_of_worker(CHECK, _outcome(-11))
    assert crash.summary == "job ddp exited with code -11"
    doc = {"status": "pass", "summary": "fine", "columns": [], "rows": [], "details": []}
    assert gpu_check.result_of_worker(CHECK, _outcome(1, doc)).status == "fail"
    ok = gpu_check.result_of_worker(CHECK, _outcome(0, doc))
    assert (ok.status, ok.summary, ok.tail) == ("pass", "fine", ())
    skip = dict(doc, status="skip", summary="no TF")
    assert gpu_check.result_of_worker(CHECK, _outcome(0, skip)).status == "skip"
    # rank 0 skipped but the job hung or crashed (another rank did not skip): not hidden
    hidden = gpu_check.result_of_worker(CHECK, _outcome(124, skip))
    assert hidden.status == "fail" and hidden.summary == "job ddp timed out after 45 s"


def test_one_failing_check_does_not_stop_the_others():
    checks = gpu_check_plan.plan(2, "o", only=("collectives", "multidim", "set_device"))
    ran = []

    def runner(job, simulate):
        ran.append(job.name)
        if job.name == "collectives":
            return gpu_check.Outcome(job, 124, None, ("stuck in allreduce",), job.timeout)
        return gpu_check.Outcome(job, 0, {"status": "pass", "summary": "ok"}, (), 1.0)

    results = gpu_check.run_checks(checks, False, runner, progress=lambda line: None)
    assert ran == ["collectives", "set_device"]  # multidim is skipped at 2 GPUs: not started
    assert [r.status for r in results] == ["fail", "skip", "pass"]
    assert results[0].tail == ("stuck in allreduce",)


def test_allreduce_document_becomes_busbw_side_by_side():
    def row(engine, size, bw, wrong=0):
        part = {"time": 1.0, "alg_bw": bw, "bus_bw": bw, "nwrong": wrong}
        return {"engine": engine, "size": size, "out_of_place": part, "in_place": part}

    doc = {"config": {"engines": ["ddl", "nccl"], "nranks": 2, "datatype": "float",
                      "op": "sum", "iterations": 20, "device": "cuda"},
           "results": [row("ddl", 8, 1.0), row("nccl", 8, 2.0), row("ddl", 32, 9.0),
                       row("nccl", 32, 10.0)],
           "average_bus_bandwidth": {"by_engine": {"ddl": 5.0, "nccl": 6.0}},
           "out_of_bounds": {"count": 0}, "devices": ["Rank 0 ..."]}
    job = Job("allreduce", 2, gpu_check_plan.PERF, (), 75.0, json="x.json")
    check = Check("allreduce", "busbw", (job,))
    got = gpu_check.result_of_allreduce(check, gpu_check.Outcome(job, 0, None, (), 9.0), doc)
    assert got.status == "pass"
    assert got.rows == (("8", "1.00", "2.00", "0.50", "0"), ("32", "9.00", "10.00", "0.90", "0"))
    assert "ddl 5.00 GB/s, nccl 6.00 GB/s" in got.summary
    bad = dict(doc, out_of_bounds={"count": 1})
    assert gpu_check.result_of_allreduce(check, gpu_check.Outcome(job, 0, None, (), 1),
                                         bad).status == "fail"
    missing = gpu_check.result_of_allreduce(check, gpu_check.Outcome(job, 1, None, ("x",), 1),
                                            None)
    assert missing.status == "fail" and missing.tail == ("x",)


def test_a_worker_that_dies_is_reported_with_its_last_lines():
    # a real ddlrun job whose ranks exit at once (argparse refuses the check's name)
    job = Job("bogus", 2, gpu_check_plan.WORKERS, ("no-such-check",), 60.0)
    out = gpu_check.run_job(job, simulate=True)
    got = gpu_check.result_of_worker(Check("bogus", "t", (job,)), out)
    assert got.status == "fail" and got.summary.startswith("job bogus exited with code ")
    assert "invalid choice: 'no-such-check'" in "\n".join(got.tail)


# ------------------------------------------------------------------- the command
def test_without_a_gpu_one_line_and_exit_0(tmp_path):
    res = _perf("--out", str(tmp_path / "report"), cwd=tmp_path,
                env=dict(ENV, CUDA_VISIBLE_DEVICES=""))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("gpu-check: no CUDA GPU visible (")
    assert lines[0].endswith("); nothing run")
    assert not (tmp_path / "report").exists()


def test_unknown_check_is_refused(tmp_path):
    res = _perf("--simulate-cpu", "2", "--only", "nope", cwd=tmp_path)
    assert res.returncode == 2 and "--only nope: no such check" in res.stderr


torch_needed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="torch is not installed")


@pytest.mark.slow
@torch_needed
def test_the_whole_pipeline_on_two_simulated_ranks(tmp_path):
    res = _perf("--simulate-cpu", "2", "--out", "report", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    report = tmp_path / "report"
    md = (report / "gpu-check.md").read_text()
    assert res.stdout.count(md) == 1  # printed at the end, as written
    assert md.startswith("# ddl-perf gpu-check: PASSED")
    results, meta = gpu_check_report.from_json((report / "gpu-check.json").read_text())
    by = {r.name: r for r in results}
    assert list(by) == NAMES
    for name in ("collectives", "allreduce", "ddp", "set_device", "train"):
        assert by[name].status == "pass", by[name]
    assert by["multidim"].status == "skip"
    tf_there = __import__("importlib").util.find_spec("tensorflow") is not None
    assert by["tensorflow"].status == ("pass" if tf_there else "skip")
    # the device engine took the dtypes Gloo reduces; int16 went through the host engines
    engines = dict((row[0], row[1]) for row in by["collectives"].rows)
    assert engines["float32"] == engines["bfloat16"] == "gloo"
    assert engines["int16"] == "host (staged)"
    assert "bitwise equal on every rank" in by["collectives"].summary
    assert "bitwise equal to DDP on gloo" in by["ddp"].summary
    assert [row[3] for row in by["set_device"].rows] == ["cpu:0", "cpu:1"]
    assert [row[0] for row in by["train"].rows] == ["ddp", "ddp-gloo"]
    assert len(by["allreduce"].rows) == 3  # 1K, 8K, 64K
    for raw in ("allreduce.json", "train-ddl.json", "train-torch.json"):
        assert (report / "raw" / raw).exists()
    assert "simulated on CPU" in meta["ranks"]


@torch_needed
def test_multidim_on_four_simulated_ranks(tmp_path):
    res = _perf("--simulate-cpu", "4", "--only", "multidim", "--out", "r", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    (result,), _ = gpu_check_report.from_json((tmp_path / "r" / "gpu-check.json").read_text())
    assert result.status == "pass", result
    assert result.summary.startswith("grid 2x2: 2 dimension(s) run")
    assert "device engine: gloo: dim0 x2 gloo -> dim1 x2 gloo" in result.details
