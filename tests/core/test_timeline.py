"""The timeline (DDL_TIMELINE, hvd.start_timeline/stop_timeline), ddl's ranges in
torch.profiler traces, and ``-dump_iter`` on one host.

Unit tests drive ddl.timeline and a Runtime in this process; the multi-process ones run
tests/core/workers/timeline.py as real ranks and read the files they write."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest

from ddl import api, runtime, timeline
from ddl.errors import DDLConfigError, DDLError
from tests.core.util import hosts_env, reports, run_worker


@pytest.fixture
def off():
    """No timeline before and after the test, whatever it started."""
    timeline.stop()
    yield
    timeline.stop()


# ------------------------------------------------------------------ in this process
def test_rank_path_follows_the_suffix_or_the_placeholder():
    assert timeline.rank_path("/x/t.json", 3) == "/x/t.rank3.json"
    assert timeline.rank_path("/x/t.JSON", 0) == "/x/t.rank0.JSON"
    assert timeline.rank_path("/x/trace", 1) == "/x/trace.rank1.json"
    assert timeline.rank_path("/x/{rank}/t.json", 2) == "/x/2/t.json"


def test_off_the_runtime_neither_wraps_nor_records(off, monkeypatch):
    """Structural, not timed: with the timeline off (and no torch profiler) a collective is
    the caller's function itself, and nothing of the recorder runs."""
    calls = []
    for name in ("queued", "inline", "span", "phase"):
        monkeypatch.setattr(timeline, name, lambda *a, _n=name, **k: calls.append(_n))
    monkeypatch.setattr(timeline.Recorder, "add", lambda *a, **k: calls.append("add"))
    rt = runtime.Runtime()
    try:
        job = lambda: 7  # noqa: E731
        assert rt.run(job, "allreduce") == 7
        with rt._cv:  # the worker is not started yet: look at what was queued
            h = rt.submit(job, "allreduce_async")
            assert rt._queue[-1][1] is job
        assert h.wait(10) == 7
    finally:
        rt.close()
    assert calls == []


def test_on_the_runtime_records_queue_and_collective(off, tmp_path):
    rec = timeline.start(str(tmp_path / "t.json"), 0, mark_cycles=True)
    rt = runtime.Runtime()
    try:
        assert rt.run(lambda: 1, "inline.call") == 1
        assert rt.submit(lambda: 2, "queued.call").wait(10) == 2
    finally:
        rt.close()
    names = [(e[0], e[1]) for e in rec.events]
    assert ("inline.call", "collective") in names
    assert ("queue", "queue") in names and ("queued.call", "collective") in names
    assert ("CYCLE_START", "cycle") in names
    timeline.stop()
    path = tmp_path / "t.rank0.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    check_trace(json.loads(path.read_text()), 0)


def test_overlapping_lane_ranges_get_their_own_rows(tmp_path):
    rec = timeline.Recorder(str(tmp_path / "x.json"), 5)
    rec.add("queue", "queue", 1.0, 3.0, lane="queue")
    rec.add("queue", "queue", 2.0, 4.0, lane="queue")  # overlaps the first
    rec.add("queue", "queue", 3.5, 5.0, lane="queue")  # after the first ended
    rec.add("a", "collective", 1.0, 2.0)
    trace = rec.trace()
    rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    queue = [e for e in trace["traceEvents"] if e["name"] == "queue"]
    assert [rows[e["tid"]] for e in queue] == ["queue #0", "queue #1", "queue #0"]
    assert all(e["pid"] == 5 for e in trace["traceEvents"])
    check_trace(trace, 5)


def test_the_recorder_stops_at_its_cap(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(timeline, "MAX_EVENTS", 3)
    rec = timeline.Recorder(str(tmp_path / "x.json"), 0)
    for i in range(5):
        rec.add(f"e{i}", "collective", float(i), float(i) + 0.5)
    assert [e[0] for e in rec.events] == ["e0", "e1", "e2"]
    assert sum("records no more" in r.getMessage() for r in caplog.records) == 1


def test_start_again_keeps_one_file_and_another_file_ends_the_first(off, tmp_path):
    a = timeline.start(str(tmp_path / "a.json"), 1)
    assert timeline.start(str(tmp_path / "a.json"), 1) is a
    a.add("x", "collective", 1.0, 2.0)
    timeline.start(str(tmp_path / "b.json"), 1)
    assert json.loads((tmp_path / "a.rank1.json").read_text())["traceEvents"][-1]["name"] == "x"
    timeline.stop()
    assert (tmp_path / "b.rank1.json").exists()
    timeline.stop()  # nothing to stop: no error
    assert timeline.recorder is None


def test_bad_paths_and_start_before_init_are_refused(off, tmp_path, monkeypatch):
    with pytest.raises(DDLConfigError, match="non-empty"):
        timeline.start("", 0)
    with pytest.raises(DDLConfigError, match="does not exist"):
        timeline.start(str(tmp_path / "missing" / "t.json"), 0)
    monkeypatch.setattr(api, "is_initialized", lambda: False)
    with pytest.raises(DDLError, match="hvd.init"):
        timeline.start_timeline(str(tmp_path / "t.json"))
    assert timeline.recorder is None


def test_no_profiler_is_seen_without_torch(monkeypatch):
    monkeypatch.delitem(timeline._modules, "torch.autograd.profiler", raising=False)
    assert timeline.torch_profiler() is None
    assert timeline.span("x", "y") is timeline._NULL


# ------------------------------------------------------------------- real ranks
def check_trace(trace: dict, rank: int) -> list[dict]:
    """A valid Trace Event Format object: returns its X and instant events after checking
    their fields, order (ts never goes back) and durations (>= 0)."""
    assert isinstance(trace["traceEvents"], list)
    events = [e for e in trace["traceEvents"] if e["ph"] in ("X", "i")]
    assert events, trace
    for e in trace["traceEvents"]:
        assert e["pid"] == rank and isinstance(e["name"], str) and e["ph"] in ("M", "X", "i")
    for e in events:
        assert isinstance(e["ts"], (int, float)) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
    ts = [e["ts"] for e in events]
    assert ts == sorted(ts), "timestamps go back"
    return events


def read_ranks(pattern: str, n: int) -> list[list[dict]]:
    out = []
    for r in range(n):
        path = pattern.format(rank=r)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        with open(path, encoding="utf-8") as f:
            out.append(check_trace(json.load(f), r))
    return out


def inside(child: dict, parents: list[dict]) -> bool:
    return any(p["tid"] == child["tid"] and p["ts"] <= child["ts"]
               and child["ts"] + child["dur"] <= p["ts"] + p["dur"] + 0.01 for p in parents)


@pytest.mark.slow
def test_ddl_timeline_writes_one_trace_per_rank(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "t.json"
    reports(run_worker("timeline.py", 2, "record", env={"DDL_TIMELINE": str(path),
                                                       "OMP_NUM_THREADS": "1"}))
    for rank, events in enumerate(read_ranks(str(tmp_path / "t.rank{rank}.json"), 2)):
        # the late peer shows on the rank that waited for it, named, for as long as it was
        waits = [e for e in events if e["name"] == "peer wait" and e["args"]["peer"] == 1]
        assert (max(e["dur"] for e in waits) >= 200_000) if rank == 0 else not waits, waits
        names = {e["name"] for e in events}
        assert {"allreduce", "allreduce_async", "allgather", "queue", "named.one",
                "negotiate", "grad.bucket0", "pack", "unpack", "shutdown"} <= names, names
        collectives = [e for e in events if e["cat"] == "collective"]
        negotiations = [e for e in events if e["name"] == "negotiate"]
        assert len(negotiations) >= 5  # named.one, 3 buckets, the plan broadcast, shutdown
        assert all(inside(e, collectives) for e in negotiations)
        assert {e["args"]["call"] for e in negotiations} >= {"allreduce", "shutdown"}
        packs = [e for e in events if e["name"] == "pack"]
        assert len(packs) == 3 and all(e["args"]["bucket"] == 0 for e in packs)
        buckets = [e for e in collectives if e["name"] == "grad.bucket0"]
        assert all(inside(e, buckets) for e in packs)  # packed on the worker, in the call
        queued = [e for e in events if e["name"] == "queue"]
        assert {e["args"]["op"] for e in queued} >= {"allreduce_async", "grad.bucket0"}


@pytest.mark.slow
def test_start_and_stop_timeline_through_ddl_torch(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "h.json"
    reps = reports(run_worker("timeline.py", 2, "hvd", str(path),
                              env={"OMP_NUM_THREADS": "1"}))
    assert all(r["empty_path_refused"] for r in reps)
    for events in read_ranks(str(tmp_path / "h.rank{rank}.json"), 2):
        names = {e["name"] for e in events}
        assert {"allreduce", "grad.bucket0", "pack", "unpack", "negotiate", "CYCLE_START"} <= names
        assert "after.stop" not in names and "shutdown" not in names  # after stop_timeline
        cycles = [e for e in events if e["name"] == "CYCLE_START"]
        assert all(e["ph"] == "i" for e in cycles)


@pytest.mark.slow
def test_torch_profiler_shows_ddl_ranges():
    pytest.importorskip("torch")
    reps = reports(run_worker("timeline.py", 2, "profiler", env={"OMP_NUM_THREADS": "1"}))
    for r in reps:
        names = set(r["names"])
        assert {"ddl:allreduce", "ddl:allreduce_async", "ddl:allgather", "ddl:grad.bucket0",
                "ddl:negotiate", "ddl:unpack"} <= names, sorted(names)
        backend = set(r["backend_names"])
        # the backend's Works ("ddl:<op>", like gloo's "gloo:all_reduce") and their calls
        assert {"ddl:allreduce", "ddl:broadcast", "ddl:torch.allreduce",
                "ddl:torch.broadcast"} <= backend, sorted(backend)


@pytest.mark.slow
def test_per_dimension_phases_across_hosts(tmp_path):
    pytest.importorskip("torch")  # the dimension across hosts runs on Gloo
    pre = hosts_env(4, 2, DDL_OPTIONS="-mode r:2x2")
    # 4 KiB rides on the identity round (its own phase); 16 KiB runs the dimensions
    reports(run_worker("timeline.py", 4, "dump", "3", "1024,4096", per_rank_env=pre,
                       env={"DDL_TIMELINE": str(tmp_path / "m.json")}))
    for events in read_ranks(str(tmp_path / "m.rank{rank}.json"), 4):
        phases = [e for e in events if e["cat"] == "phase"]
        assert {e["name"] for e in phases} == {"identity round", "dim0 reduce_scatter",
                                               "dim1 allreduce", "dim0 allgather"}
        assert all(e["args"]["bytes"] > 0 for e in phases)
        assert [e["args"]["bytes"] for e in phases if e["name"] == "identity round"] == [4096] * 3
        collectives = [e for e in events if e["cat"] == "collective"]
        on_caller = [e for e in phases if e["name"].startswith("dim0")]
        assert all(inside(e, collectives) for e in on_caller)


@pytest.mark.parametrize("per,mode", [(2, ""), (1, "-mode r:2x2")],
                         ids=["2 hosts of 2", "2x2 grid across hosts"])
def test_a_rank_recording_alone_changes_no_result(tmp_path, per, mode):
    pytest.importorskip("torch")
    pre = hosts_env(4, per, **({"DDL_OPTIONS": mode} if mode else {}))
    for r in reports(run_worker("timeline_alone.py", 4, str(tmp_path / "a.json"),
                                per_rank_env=pre, env={"DDL_TIMEOUT": "20"})):
        assert r["right"] == [True] * 4, r
    phases = {e["name"] for e in read_ranks(str(tmp_path / "a.rank{rank}.json"), 1)[0]
              if e["cat"] == "phase"}
    assert "identity round" in phases, phases


DUMP_LINE = re.compile(r"^\[ddl\] allreduce #(\d+) \(4096 B\): dim0 x2 shm/one-step; "
                       r"wall \d+\.\d\d ms per call$", re.M)


def test_dump_iter_prints_on_one_host():
    res = run_worker("timeline.py", 2, "dump", "10", env={"DDL_OPTIONS": "-dump_iter 4"})
    reports(res)
    assert [int(n) for n in DUMP_LINE.findall(res[0].stderr)] == [4, 8], res[0].stderr
    assert not DUMP_LINE.search(res[1].stderr)  # rank 0 only
