"""examples/elastic_torch.py under ddlrun, real processes: a job of 3 workers that loses
one right after a commit finishes on 2, with the very parameters (bit for bit) of a
reference run that makes the same change of world at the same commit by hand (3 ranks to
that commit, saved; then 2 ranks from the save); and the job without a failure completes.

Each run is a few seconds; the four runs are made once for the module."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("needs torch", allow_module_level=True)

from procs import run_ddlrun  # noqa: E402 - after the skip

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "elastic_torch.py")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
# 240 samples, 8 a batch: 10 batches an epoch on 3 ranks; a commit every 3 batches, so
# commit 2 is batch 6's, and the worker dies right after batch 7 (one past the commit)
TRAIN = ["--epochs", "2", "--batches-per-commit", "3", "--batch-size", "8",
         "--samples", "240"]
COMMIT, FAIL_AT = 2, 7
ELASTIC = ["-np", "3", "--min-np", "2", "--max-np", "3"]


def ddlrun(cwd: str, launch: list[str], *args: str) -> subprocess.CompletedProcess:
    """``ddlrun LAUNCH... python examples/elastic_torch.py TRAIN... ARGS...``."""
    return run_ddlrun(*launch, sys.executable, EXAMPLE, *TRAIN, *args, timeout=240, cwd=cwd,
                      env={**os.environ, **ENV})


def final(p: subprocess.CompletedProcess) -> dict[str, str]:
    """Rank 0's FINAL line as a dict (``epochs``, ``commits``, ``size``, ``sha256``)."""
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[0] FINAL ")]
    assert len(lines) == 1, out[-4000:]
    return dict(pair.split("=", 1) for pair in lines[0].split()[2:])


def notes(p: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("ddlrun: ")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    cwd = str(tmp_path_factory.mktemp("elastic_torch"))
    saved = os.path.join(cwd, f"commit{COMMIT}.pt")
    out = {
        "lost": ddlrun(cwd, ELASTIC, "--fail-worker", "localhost:1",
                       "--fail-at-batch", str(FAIL_AT)),
        "to_commit": ddlrun(cwd, ["-np", "3"], "--save-at-commit", str(COMMIT), saved),
    }
    out["from_commit"] = ddlrun(cwd, ["-np", "2"], "--load", saved)
    out["whole"] = ddlrun(cwd, ELASTIC)
    return out


def test_a_lost_worker_ends_with_the_parameters_of_the_same_change_made_by_hand(runs):
    to_commit = runs["to_commit"]
    assert to_commit.returncode == 0, (to_commit.stdout + to_commit.stderr)[-4000:]
    assert f"[0] SAVED commit={COMMIT} epoch=0 batch=6" in to_commit.stdout
    lost, reference = final(runs["lost"]), final(runs["from_commit"])
    assert lost["size"] == reference["size"] == "2"
    assert lost["epochs"] == reference["epochs"] == "2"
    assert lost["sha256"] == reference["sha256"]  # bit for bit
    # and the change of world did change the result: the job without it ends elsewhere
    assert final(runs["whole"])["sha256"] != lost["sha256"]


def test_ddlrun_says_what_happened_to_the_world(runs):
    said = notes(runs["lost"])
    assert said[0].startswith("ddlrun: world 0 (start): 3 ranks"), said
    failed = [ln for ln in said if "worker localhost:1" in ln]
    assert len(failed) == 1 and "failed" in failed[0] and "SIGKILL" in failed[0], said
    assert any(re.match(r"ddlrun: world 1 \(.*\): 2 ranks", ln) for ln in said), said
    assert f"ddlrun: world 1 goes on from commit {COMMIT} (restored)" in said
    assert not any("world 2" in ln for ln in said), said  # one change, one new world


def test_the_job_without_a_failure_completes_in_one_world(runs):
    whole = runs["whole"]
    result = final(whole)
    assert (result["size"], result["epochs"]) == ("3", "2")
    # 10 batches an epoch: commits at batches 3, 6, 9 and at the epoch's end
    assert result["commits"] == "8"
    said = notes(whole)
    assert said[0].startswith("ddlrun: world 0 (start): 3 ranks"), said
    assert not any("world 1" in ln or "failed" in ln for ln in said), said
