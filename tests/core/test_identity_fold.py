"""The identity exchange folded into each call's first step (issue 13): a Horovod-level call
costs no collective of its own, on one host (the shared-memory engine's first step) and
across hosts (the first message, engines/identity_round.py), and every safety property of
the separate exchange still holds (ddl.hvd.fold's module docstring)."""

from __future__ import annotations

import pytest

from .util import hosts_env, reports, run_worker

pytestmark = pytest.mark.slow

# ranks, per-rank environment (simulated hosts), the engine
LAYOUTS = {"one host": (2, None, "shm"), "2 hosts": (2, hosts_env(2, 1), "ddl/gloo"),
           # ddlrun's grid for 2 hosts of 2: shared memory inside each, Gloo across
           "2 hosts of 2": (4, hosts_env(4, 2, DDL_OPTIONS="-mode r:2x2"), "ddl/gloo"),
           # two dimensions across hosts: the round goes over the whole group
           "4 hosts, 2x2 grid": (4, hosts_env(4, 1, DDL_OPTIONS="-mode r:2x2"), "ddl/gloo"),
           # the host's ranks, then two dimensions across hosts: one row per host
           "4 hosts of 2, 3-D grid": (8, hosts_env(8, 2, DDL_OPTIONS="-mode r:2x2x2"),
                                      "ddl/gloo")}
TWO_RANKS = ["one host", "2 hosts"]


def _run(scenario: str, layout: str = "one host") -> list[dict]:
    n, per_rank, engine = LAYOUTS[layout]
    got = reports(run_worker("identity_fold.py", n, scenario, timeout=180,
                             per_rank_env=per_rank))
    assert [r["engine"] for r in got] == [engine] * n
    return got


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_calls_take_no_separate_exchange(layout):
    for rank in _run("calls", layout):
        assert rank["wrong"] == []
        assert rank["separate"] == 0  # 104 calls, every identity rode on its data


@pytest.mark.parametrize("layout", TWO_RANKS)
def test_mismatches_through_the_folded_path_raise_on_every_rank(layout):
    r0, r1 = _run("mismatch", layout)
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
        if layout == "one host":
            assert rank["mixed"]["type"] == "DDLMismatchError"
            assert "core ddl call" in rank["mixed"]["text"]
    # the call failed on rank 1 (a bad root): it raises its own error, rank 0 names it
    assert r1["failed"] == {"type": "DDLConfigError", "text": "root_rank 5 is outside 0..1"}
    assert r0["failed"]["type"] == "DDLMismatchError"
    assert "failed here: DDLConfigError: root_rank 5" in r0["failed"]["text"]


@pytest.mark.parametrize("layout", TWO_RANKS)
def test_a_joined_rank_serves_folded_calls(layout):
    r0, r1 = _run("join", layout)
    assert r0["sums"] == [1.0, 1.0, 1.0]  # the joined rank contributed zeros
    assert r0["last"] == r1["last"] == 0
    assert r0["after"] == r1["after"] == 2.0
