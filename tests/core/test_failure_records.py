"""What a rank that dies says about itself (its failure record, ddl.failures) and what its
peers are told: that its process is exiting, and with which exception, never that it
called ``ddl.shutdown()`` when its program did not."""

import importlib.util
import json
import os
import stat
import time
from pathlib import Path

import pytest

from ddl import failures
from ddl.errors import DDLError, DDLMismatchError, DDLPeerError, DDLTimeoutError

from .util import WORKERS, hosts_env, reports, run_worker

LEAVING = os.path.join(WORKERS, "leaving.py")


def line_of(text: str) -> int:
    return Path(LEAVING).read_text().splitlines().index(text) + 1


def caught(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        return exc
    raise AssertionError("nothing was raised")


# ------------------------------------------------------------------- in this process
def test_consequences_of_a_peer_are_told_apart_from_causes():
    peer = DDLPeerError("rank 0: rank 1's process is exiting (ValueError: x) while ...")
    assert failures.after_peer(peer) and failures.after_peer(DDLTimeoutError("rank 0: slow"))
    # torch's futures re-raise it as a RuntimeError carrying the text; TF as an op error
    assert failures.after_peer(RuntimeError(f"Got the following error: DDLPeerError: {peer}"))
    # the engine's later "failed earlier (...)" error, and a user's error raised while
    # handling a peer's
    assert failures.after_peer(DDLError(f"rank 0: the engine failed earlier ({peer})"))

    def handling():
        try:
            raise DDLTimeoutError("rank 0: allreduce timed out after 1s")
        except DDLError:
            raise ValueError("retry failed") from None  # context stays

    assert failures.after_peer(caught(handling))
    assert not failures.after_peer(ValueError("boom"))
    assert not failures.after_peer(DDLMismatchError("rank 0: ranks disagree"))


def test_the_user_frame_is_outside_ddl_and_prefers_the_programs_own_code():
    import ddl

    exc = caught(lambda: ddl.allreduce([1.0]))  # raised inside ddl (not initialized)
    assert failures.user_frame(exc.__traceback__)[:2] == (__file__, _line_of_call(exc))
    exc = caught(lambda: json.loads("{"))  # raised in the standard library
    assert failures.user_frame(exc.__traceback__)[0] == __file__
    assert failures.user_frame(None) == ("", 0, "")


def _line_of_call(exc: BaseException) -> int:
    """The line of this file nearest the raise (the lambda's)."""
    tb, found = exc.__traceback__, 0
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == __file__:
            found = tb.tb_lineno
        tb = tb.tb_next
    return found


def test_record_and_reason():
    exc = caught(lambda: (_ for _ in ()).throw(KeyError("missing")))
    rec = failures.record(exc, "MainThread")
    assert rec["type"] == "KeyError" and rec["message"] == "'missing'"
    assert rec["file"] == __file__ and rec["after_peer"] is False
    assert abs(rec["time"] - time.time()) < 5 and rec["pid"] == os.getpid()
    assert "KeyError" in rec["traceback"]
    assert failures.reason(ValueError("boom\nsecond line")) == "ValueError: boom"
    long = failures.reason(ValueError("x" * 500))
    assert len(long) == failures.REASON_CHARS and long.endswith("...")


def test_records_are_written_whole_and_private(tmp_path):
    path = str(tmp_path / "rank-0.json")
    assert failures.write(path, {"type": "ValueError", "message": "\udcff boom"})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(Path(path).read_text())["type"] == "ValueError"
    assert os.listdir(tmp_path) == ["rank-0.json"]  # no temporary file left
    assert not failures.write(str(tmp_path / "missing" / "r.json"), {})


# ------------------------------------------------------------------------- real ranks
def messages(how: str, n: int = 3, per_rank_env=None) -> dict[int, str]:
    results = run_worker("leaving.py", n, how, "catch", env=dict(DDL_TIMEOUT="30"),
                         per_rank_env=per_rank_env)
    return {r["rank"]: r["msg"] for r in reports([x for x in results if x.rank != n - 1])
            if r["kind"] == "DDLPeerError"}


def test_a_rank_dying_of_an_exception_is_reported_as_exiting_with_it():
    msgs = messages("raise")
    assert sorted(msgs) == [0, 1]
    for rank, msg in msgs.items():
        assert msg == (f"rank {rank}: rank 2's process is exiting (ValueError: boom) while this "
                       "rank waits in allreduce(float32[4], Average)")


def test_a_script_that_ends_is_reported_as_exiting_without_an_exception():
    for rank, msg in messages("end").items():
        assert msg == (f"rank {rank}: rank 2's process is exiting (no exception: its script "
                       "ended or called exit()) while this rank waits in allreduce(float32[4], "
                       "Average)")


def test_the_programs_own_shutdown_is_still_reported_as_such():
    msgs = messages("shutdown", 2)
    assert msgs == {0: "rank 0: rank 1 called ddl.shutdown() while this rank waits in "
                       "allreduce(float32[4], Average)"}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the gloo engine: torch")
def test_across_hosts_the_peers_hear_why_too():
    msgs = messages("raise", 4, hosts_env(4, 2))
    assert not [m for m in msgs.values() if "called ddl.shutdown()" in m]
    # rank 0 serves the store the leaving rank wrote its reason to: it always hears it
    assert "rank 3's process is exiting (ValueError: boom)" in msgs[0], msgs


def test_every_failed_rank_writes_its_record_and_only_the_cause_is_not_a_consequence(
        tmp_path):
    paths = [str(tmp_path / f"r{r}.json") for r in range(3)]
    t0 = time.time()
    results = run_worker("leaving.py", 3, "raise", "uncaught", env=dict(DDL_TIMEOUT="30"),
                         per_rank_env=[{"DDL_ERROR_FILE": p} for p in paths])
    assert [r.returncode for r in results] == [1, 1, 1]
    recs = [json.loads(Path(p).read_text()) for p in paths]
    cause, peers = recs[2], recs[:2]
    assert (cause["type"], cause["message"], cause["after_peer"]) == ("ValueError", "boom",
                                                                      False)
    assert (cause["file"], cause["line"]) == (LEAVING, line_of('        raise ValueError("boom")'))
    assert cause["rank"] == 2 and cause["thread"] == "MainThread"
    for r, rec in enumerate(peers):
        assert rec["type"] == "ddl.errors.DDLPeerError" and rec["after_peer"] is True
        assert (rec["file"], rec["line"], rec["rank"]) == (LEAVING, _uncaught_line(), r)
        assert rec["time"] > cause["time"]
    assert t0 < cause["time"] < time.time()


def _uncaught_line() -> int:
    """The allreduce under ``if peers == "uncaught":``, the one the peers die in."""
    return line_of('if peers == "uncaught":') + 1
