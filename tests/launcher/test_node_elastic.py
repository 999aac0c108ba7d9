"""One ddlrun per node, torchrun's elastic way (``--nnodes MIN:MAX``, ``--max-restarts``,
``--rdzv-endpoint``), with real processes: two ddlruns on this host play two nodes of 2
ranks each and meet at a rendezvous the first one serves. The worker
(scripts/node_rounds.py) checks every allreduce against the world size and prints its
rank, world and restart count at the end, so each outcome is exact: a failed rank restarts
every node (TORCHELASTIC_RESTART_COUNT counts), without restarts left every node exits
with that rank's code naming it, a node that comes later grows the job, a node lost with
its ddlrun leaves the job to the others. Nothing is left behind. Bad flags are one line."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
from ddlrun_testlib import HERE, PY, ddlrun_argv, run_ddlrun, shm_left, wait_gone

from ddlrun.plan_types import attempt_job_id

SCRIPT = str(HERE / "scripts" / "node_rounds.py")
SECRET = "node-elastic-test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One node's ddlrun, started now; its output read as it comes (threads)."""

    def __init__(self, job: str, port: int, marker: str, nodes: str, restarts: int,
                 host: str = "127.0.0.1", prefix: tuple[str, ...] = (),
                 extra: tuple[str, ...] = (), **env: str) -> None:
        argv = [*prefix, *ddlrun_argv(
            *extra, "--nnodes", nodes, "--nproc-per-node", "2", "--max-restarts", str(restarts),
            "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", job,
            "--rdzv-conf", "last_call_timeout=1,close_timeout=5", PY, SCRIPT, marker)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True,
                                     env={**os.environ, "DDL_JOB_SECRET": SECRET, **env})
        self._out: list[str] = []
        self._err: list[str] = []
        self._readers = [threading.Thread(target=lambda f=f, b=b: b.extend(f), daemon=True)
                         for f, b in ((self.proc.stdout, self._out),
                                      (self.proc.stderr, self._err))]
        for t in self._readers:
            t.start()

    @property
    def out(self) -> str:
        return "".join(self._out)

    @property
    def err(self) -> str:
        return "".join(self._err)

    def wait(self, timeout: float = 150) -> int:
        self.proc.wait(timeout)
        for t in self._readers:
            t.join(10)
        return self.proc.returncode

    def wait_for(self, text: str, timeout: float = 60, others: tuple[Node, ...] = ()) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.err:
            assert time.monotonic() < deadline, f"no {text!r} within {timeout}s: " + \
                "\n---\n".join(n.err for n in (self, *others))
            time.sleep(0.05)

    def wait_ready(self, restart: int = 0, timeout: float = 90) -> None:
        """Until both of this node's ranks have initialised ddl in that start of the job."""
        deadline = time.monotonic() + timeout
        while sum("ready rank" in ln and ln.endswith(f"restart {restart}")
                  for ln in self.out.splitlines()) < 2:
            assert time.monotonic() < deadline, f"not ready within {timeout}s: {self.err}"
            time.sleep(0.05)

    def done(self) -> list[str]:
        return sorted(ln.split("] ", 1)[1] for ln in self.out.splitlines() if "done rank" in ln)


def notes(node: Node) -> list[str]:
    return [ln for ln in node.err.splitlines() if ln.startswith("ddlrun: ")
            and not ln.startswith("ddlrun:   ")]


@pytest.fixture
def job(marker):
    return f"ne_{marker[-8:]}"


def assert_clean(job: str, marker: str, rounds: int) -> None:
    assert wait_gone(marker, 10) == []
    for n in range(rounds + 1):
        assert shm_left(attempt_job_id(job, n)) == []


@pytest.mark.slow
def test_a_failed_rank_restarts_every_node_through_the_rendezvous(job, marker):
    port = free_port()
    a = Node(job, port, marker, "2", 1)
    time.sleep(0.5)  # the first one serves the rendezvous
    b = Node(job, port, marker, "2", 1, FAIL_RANK="3", FAIL_RESTART="0")
    assert (a.wait(), b.wait()) == (0, 0), a.err + b.err
    assert a.done() == [f"done rank {r} of 4 restart 1 run {job} max 1" for r in (0, 1)]
    assert b.done() == [f"done rank {r} of 4 restart 1 run {job} max 1" for r in (2, 3)]
    pid = re.escape(socket.gethostname())
    assert any(re.fullmatch(rf"ddlrun: rank 3 on node 1 \({pid}:\d+\) exited with code 3; "
                            r"restart 1 of 1: every node starts again", ln)
               for ln in notes(b)), b.err
    assert any("this node's ranks failed because of a peer; round 1 began: rank 3 on node 1"
               in ln for ln in notes(a)), a.err
    assert "round 1: 2 node(s), this is node 0 with ranks 0-1 of 4" in a.err
    assert_clean(job, marker, 1)


@pytest.mark.slow
def test_without_restarts_left_every_node_exits_with_the_failed_ranks_code(job, marker):
    port = free_port()
    a = Node(job, port, marker, "2", 1)
    time.sleep(0.5)
    b = Node(job, port, marker, "2", 1, FAIL_RANK="3", FAIL_RESTART="*")
    assert (a.wait(), b.wait()) == (3, 3), a.err + b.err
    for node in (a, b):
        last = notes(node)[-1]
        assert re.fullmatch(r"ddlrun: job ended: rank 3 on node 1 \(\S+:\d+\) exited with "
                            r"code 3; no restart left \(--max-restarts 1\)", last), node.err
    assert a.done() == b.done() == []
    assert_clean(job, marker, 2)


@pytest.mark.slow
def test_a_node_that_comes_later_grows_the_job_without_using_a_restart(job, marker):
    port = free_port()
    a = Node(job, port, marker, "1:2", 0, STEPS="40", SLOW="0.1")
    a.wait_for("round 0: 1 node(s), this is node 0 with ranks 0-1 of 2")
    b = Node(job, port, marker, "1:2", 0, STEPS="40", SLOW="0.1")
    assert (a.wait(), b.wait()) == (0, 0), a.err + b.err
    assert a.done() == [f"done rank {r} of 4 restart 0 run {job} max 0" for r in (0, 1)]
    assert b.done() == [f"done rank {r} of 4 restart 0 run {job} max 0" for r in (2, 3)]
    assert "1 node(s) waiting to join" in a.err
    assert_clean(job, marker, 1)


@pytest.mark.slow
def test_a_node_lost_with_its_ddlrun_leaves_the_job_to_the_others(job, marker):
    port = free_port()
    a = Node(job, port, marker, "1:2", 1, STEPS="100", SLOW="0.1")
    time.sleep(0.5)
    b = Node(job, port, marker, "1:2", 1, STEPS="100", SLOW="0.1")
    b.wait_ready()
    os.killpg(b.proc.pid, signal.SIGKILL)  # the node's ddlrun and its ranks, as a host dies
    b.proc.wait(10)
    assert a.wait(200) == 0, a.err
    assert a.done() == [f"done rank {r} of 2 restart 1 run {job} max 1" for r in (0, 1)]
    assert re.search(r"because of a peer, and node\(s\) \S+ of round 0 stopped beating for 2 "
                     r"s without reporting a cause \(lost with their host\?\); restart 1 of 1",
                     a.err), a.err
    assert_clean(job, marker, 1)


@pytest.mark.parametrize("args,text", [
    (["--nnodes", "4:2"], "--nnodes 4:2: MIN 4 is greater than MAX 2"),
    (["--nnodes", "0:2", "--rdzv-endpoint", "127.0.0.1"], "--nnodes 0:2: MIN must be at "
     "least 1"),
    (["-H", "localhost:2,127.0.0.1:2", "--nnodes", "1:2"], "--nnodes 1:2 is for one ddlrun "
     "per node (torchrun's way, without -H/--hostfile); with hosts given, use "
     "--min-np/--max-np (Horovod's elastic training)"),
    (["--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1"],
     "--node-rank: with --nnodes MIN:MAX or --max-restarts the nodes take their ranks in "
     "the rendezvous, as torchrun's c10d does: drop it"),
    (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1", "--rdzv-conf", "join_timeout=x"],
     "--rdzv-conf join_timeout='x': seconds from 0 to 86400"),
    (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1", "--rdzv-conf", "read_timeout=5"],
     "--rdzv-conf 'read_timeout=5': expected KEY=SECONDS with KEY one of join_timeout, "
     "last_call_timeout, close_timeout"),
    (["-n", "2", "--rdzv-conf", "join_timeout=5"], "--rdzv-conf goes with --nnodes MIN:MAX "
     "or --max-restarts and one ddlrun per node"),
])
def test_bad_node_elastic_flags_are_one_usage_line(args, text):
    res = run_ddlrun(*args, PY, SCRIPT, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [f"ddlrun: error: {text}"]



@pytest.mark.slow
def test_a_signal_to_one_nodes_ddlrun_stops_that_node_and_the_others_go_on(job, marker):
    # preemption: the rendezvous stays open (torchrun's rule on a signal), the stopped node
    # opens the next round for the others at once
    port = free_port()
    a = Node(job, port, marker, "1:2", 1, STEPS="100", SLOW="0.1")
    time.sleep(0.5)
    b = Node(job, port, marker, "1:2", 1, STEPS="100", SLOW="0.1")
    b.wait_ready()
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait(60) == 143, b.err
    assert a.wait(200) == 0, a.err
    assert a.done() == [f"done rank {r} of 2 restart 1 run {job} max 1" for r in (0, 1)]
    assert re.search(r"round 1 began \(node 1 \(\S+:\d+\) stopped \(exited with code 143\)\)",
                     a.err), a.err
    assert_clean(job, marker, 1)
