"""The identity exchange folded into the shared-memory engine's first step (issue 13): on
one host a Horovod-level call costs no collective of its own, and every safety property of
the separate exchange still holds (negotiate's module docstring)."""

from __future__ import annotations

import pytest

from .util import reports, run_worker

pytestmark = pytest.mark.slow


def _run(scenario: str) -> list[dict]:
    got = reports(run_worker("identity_fold.py", 2, scenario, timeout=180))
    assert [r["engine"] for r in got] == ["shm", "shm"]
    return got


def test_calls_on_one_host_take_no_separate_exchange():
    for rank in _run("calls"):
        assert rank["wrong"] == []
        assert rank["separate"] == 0  # 104 calls, every identity rode on its data


def test_mismatches_through_the_folded_path_raise_on_every_rank():
    r0, r1 = _run("mismatch")
    for rank in (r0, r1):
        numel = rank["numel"]
        assert numel["type"] == "DDLMismatchError"
        assert "hvd.allreduce(float32[256], op=Sum, name='grads')" in numel["text"]
        assert "hvd.allreduce(float32[512], op=Sum, name='grads')" in numel["text"]
        large = rank["numel_large"]
        assert large["type"] == "DDLMismatchError"
        assert "float32[262144]" in large["text"] and "float32[262208]" in large["text"]
        kind = rank["kind"]
        assert kind["type"] == "DDLMismatchError"
        assert "hvd.allreduce(float32[8]" in kind["text"]
        assert "hvd.broadcast(float32[8], root_rank=0)" in kind["text"]
        assert rank["after_ok"] and rank["separate_after"] == 0
        assert rank["mixed"]["type"] == "DDLMismatchError"
        assert "core ddl call" in rank["mixed"]["text"]
    # the call failed on rank 1 (a bad root): it raises its own error, rank 0 names it
    assert r1["failed"] == {"type": "DDLConfigError", "text": "root_rank 5 is outside 0..1"}
    assert r0["failed"]["type"] == "DDLMismatchError"
    assert "failed here: DDLConfigError: root_rank 5" in r0["failed"]["text"]


def test_a_joined_rank_serves_folded_calls():
    r0, r1 = _run("join")
    assert r0["sums"] == [1.0, 1.0, 1.0]  # the joined rank contributed zeros
    assert r0["last"] == r1["last"] == 0
    assert r0["after"] == r1["after"] == 2.0
