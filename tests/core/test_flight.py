"""The flight recorder (ddl.flight): the ring the runtime writes, its summary, its dumps
(on the first timeout/peer loss/mismatch, and on SIGURG), private files, and off when
DDL_FLIGHT_RECORDER=0."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

import ddl
from ddl import flight
from ddl.errors import DDLPeerError
from ddl.runtime import Runtime


@pytest.fixture
def ring(tmp_path, monkeypatch):
    monkeypatch.setattr(flight, "ring", flight.Ring(8, rank=3, folder=str(tmp_path / "fl")))
    return flight.ring


def test_sync_and_queued_calls_are_numbered_per_queue(ring):
    rt, other = Runtime("job"), Runtime("group [0, 1]")
    rt.run(lambda: 1, "allreduce", (np.dtype("float32"), (4, 3), ddl.Sum))
    rt.submit(lambda: 2, "broadcast").wait()
    other.run(lambda: 3, "allgather")
    rt.close()
    other.close()
    q = flight.queues(flight.snapshot()["entries"])
    assert q["job"]["issued"] == 2 and q["group [0, 1]"]["issued"] == 1
    first, second = q["job"]["done"]
    assert (first["seq"], first["name"], first["what"]) == (0, "allreduce", "float32[4, 3], Sum")
    assert second["seq"] == 1 and second["started"] >= second["queued"]
    assert all(e["ended"] >= e["started"] for e in q["job"]["done"])


def test_a_call_done_inline_ends_when_the_next_of_its_queue_began(ring):
    rt, other = Runtime("job"), Runtime("group [0, 1]")
    rt.run(lambda: None, "first")
    time.sleep(0.05)
    other.run(lambda: None, "elsewhere")
    rt.run(lambda: None, "second")
    first, elsewhere, second = flight.snapshot()["entries"]
    assert (first["name"], elsewhere["name"], second["name"]) == ("first", "elsewhere", "second")
    assert first["state"] == "done" and first["ended"] == second["queued"]  # its own queue's
    assert second["state"] == "done" and second["ended"] is None  # the last: no end yet known
    assert elsewhere["ended"] is None


def test_the_ring_keeps_the_newest_entries_in_order(ring):
    rt = Runtime()
    for i in range(20):
        rt.run(lambda: None, f"c{i}")
    names = [e["name"] for e in flight.snapshot()["entries"]]
    assert names == [f"c{i}" for i in range(12, 20)]


def test_a_failed_call_is_marked_and_a_peer_loss_dumps_once(ring):
    rt = Runtime()

    def lost():
        raise DDLPeerError("rank 1 died")

    for _ in range(2):
        with pytest.raises(DDLPeerError):
            rt.run(lost, "allreduce")
    path = flight.dump_path()
    with open(path) as f:
        data = json.load(f)
    assert data["reason"].startswith("DDLPeerError: rank 1 died")
    assert [e["state"] for e in data["entries"]] == ["failed"]  # dumped at the first
    assert data["entries"][0]["error"] == "DDLPeerError"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert flight.summary()["dump"] == path


def test_an_ordinary_error_does_not_dump(ring):
    with pytest.raises(ValueError):
        Runtime().run(lambda: (_ for _ in ()).throw(ValueError("x")), "allreduce")
    assert not os.path.exists(flight.dump_path())
    assert flight.snapshot()["entries"][-1]["state"] == "failed"


def test_waits_are_noted_and_cleared(ring):
    flight.note_wait(1, 7, 6, flight.clock() - 2.0)
    (w,) = flight.snapshot()["waits"]
    assert (w["peer"], w["step"], w["peer_step"]) == (1, 7, 6)
    assert time.time() - w["since"] == pytest.approx(2.0, abs=0.5)
    flight.end_wait()
    assert flight.snapshot()["waits"] == []


def test_what_text():
    assert flight.what_text(None) == ""
    assert flight.what_text((np.dtype("float64"), (), "sum")) == "float64[], Sum"
    torch = pytest.importorskip("torch")
    t = torch.ones(2, 5, dtype=torch.bfloat16)
    assert flight.what_text((t.dtype, t.shape, None)) == "bfloat16[2, 5]"


CHILD = r"""
import os, sys, time, numpy as np, ddl
ddl.init()
ddl.allreduce(np.ones(3, np.float32))
print("ready", flush=True)
time.sleep(30)
"""


def test_sigurg_dumps_the_ring_and_where_the_program_is(tmp_path):
    env = {**os.environ, "DDL_FLIGHT_DIR": str(tmp_path)}
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(v, None)
    p = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert int((tmp_path / "rank0.pid").read_text()) == p.pid
        time.sleep(0.5)  # into its sleep
        p.send_signal(signal.SIGURG)
        deadline = time.monotonic() + 20
        while not (tmp_path / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        data = json.loads((tmp_path / "rank0.json").read_text())
        assert data["reason"].startswith("asked (SIGURG)")
        assert data["queues"]["job"]["issued"] == 1
        assert data["at"]["file"] == "<string>" and data["at"]["line"] == 6
        assert "MainThread" in data["stacks"]
        main = "".join(data["stacks"]["MainThread"])
        assert main.endswith('File "<string>", line 6, in <module>\n') and "flight" not in main
        assert "(most recent call first)" in (tmp_path / "rank0.stacks.txt").read_text()
        assert p.poll() is None  # asking does not stop it
    finally:
        p.kill()
        p.wait()


def test_off_when_asked(tmp_path):
    env = {**os.environ, "DDL_FLIGHT_RECORDER": "0", "DDL_FLIGHT_DIR": str(tmp_path)}
    code = ("import ddl, ddl.flight as f, numpy as np; ddl.init(); "
            "ddl.allreduce(np.ones(2)); print(f.ring, f.summary())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["None", "None"]
    assert os.listdir(tmp_path) == []


def test_an_odd_name_is_written_as_text_and_never_changes_the_error(ring):
    from pathlib import Path

    def lost():
        raise DDLPeerError("gone")

    with pytest.raises(DDLPeerError):
        Runtime().run(lost, Path("odd"))
    with open(flight.dump_path()) as f:
        assert json.load(f)["entries"][-1]["name"] == "odd"
    from ddl import failures
    json.dumps(failures.record(DDLPeerError("x")), default=str)


def test_a_dump_during_a_dump_is_skipped_not_corrupted(ring):
    assert flight._dumping.acquire(blocking=False)
    try:
        assert flight.dump("nested") is None
    finally:
        flight._dumping.release()
    assert flight.dump("alone") == flight.dump_path()
    assert not [n for n in os.listdir(os.path.dirname(flight.dump_path())) if ".tmp" in n]


def test_a_forked_child_is_not_the_rank(ring):
    pid = os.fork()
    if pid == 0:  # the child: no recorder, nothing of the parent's taken back
        os._exit(0 if flight.ring is None and flight.dump("child") is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert flight.ring is ring


def test_the_job_queue_is_in_the_summary_before_its_first_call_and_reinit_starts_afresh(
        tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_FLIGHT_DIR", str(tmp_path / "f"))
    monkeypatch.setattr(flight, "ring", None)
    flight.start(0, "j")
    first = flight.ring
    Runtime("job")
    assert flight.summary()["queues"]["job"]["issued"] == 0
    flight.start(0, "j")
    assert flight.ring is not first
    flight.left_job()
    monkeypatch.setattr(flight, "ring", None)


def test_a_folder_another_user_could_write_is_refused(tmp_path):
    base = tmp_path / "ddl-flight-0"
    base.mkdir(mode=0o777)
    os.chmod(base, 0o777)
    with pytest.raises(OSError, match="not a private folder"):
        flight._ensure(str(base / "job"))
    os.chmod(base, 0o700)
    flight._ensure(str(base / "job"))
    assert stat.S_IMODE(os.stat(base / "job").st_mode) == 0o700
