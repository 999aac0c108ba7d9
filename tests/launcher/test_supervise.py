"""The verdict: the earliest failure by the time it happened, stopped ranks named first,
follow-on failures named, not repeated. A fake backend (the seam) for the rules; the agent
protocol for real, with agents on this host standing in for ssh."""

import io
import json
import re
import threading
import time

from ddlrun_testlib import PY, WORKER, wait_gone

from ddlrun.backends import Backend, LaunchOptions
from ddlrun.backends.ssh import AgentBackend
from ddlrun.events import RankExit, Stuck
from ddlrun.hosts import HostSpec
from ddlrun.output import OutputSink
from ddlrun.plan import Request, make_plan
from ddlrun.run import supervise


def plan_of(nranks=3, hosts=None, program=("prog",), secret="s3cr3t"):
    hosts = hosts or (HostSpec("localhost", nranks),)
    return make_plan(Request(tuple(program), hosts), {}, "jsup", 29500, {},
                     {"DDL_JOB_SECRET": secret})


class Scripted(Backend):
    """Emits the given (delay, event) pairs from a thread, as a real backend would."""

    name = "scripted"

    def __init__(self, script, stuck=()):
        super().__init__(LaunchOptions())
        self.script, self._stuck, self.closed = script, list(stuck), False

    def start(self, plan, sink, emit):
        def run():
            for delay, ev in self.script:
                time.sleep(delay)
                emit(ev)

        threading.Thread(target=run, daemon=True).start()

    def stuck(self, timeout):
        return self._stuck

    def close(self, timeout):
        self.closed = True


def notes(err: io.StringIO) -> list[str]:
    return [ln[len("ddlrun: "):] for ln in err.getvalue().splitlines()
            if ln.startswith("ddlrun: ") and not ln.startswith("ddlrun:   |")]


def test_earliest_exit_wins_even_when_heard_of_later():
    t = time.monotonic()
    # rank 0's failure arrives first, but rank 1 exited 50 ms before it
    script = [(0.05, RankExit(0, 0, 1, 100, t + 0.10)), (0.05, RankExit(1, 0, 3, 101, t + 0.05)),
              (0.0, RankExit(2, 0, 1, 102, t + 0.12))]
    err = io.StringIO()
    backend = Scripted(script)
    out = supervise(plan_of(), backend, OutputSink(stdout=io.StringIO(), stderr=err))
    assert out.code == 3 and out.failure.rank == 1 and backend.closed
    lines = notes(err)
    assert lines[0] == ("rank 1 on host localhost (pid 101) exited with code 3; stopping the "
                        "other ranks")
    assert any(ln.startswith("then rank 0 (exited with code 1), rank 2 (exited with code 1): "
                             "follow-on failures of rank 1") for ln in lines)
    assert lines[-1].startswith("job jsup ended with exit code 3")


def test_a_stopped_rank_is_named_first_and_the_failing_rank_second():
    t = time.monotonic()
    err = io.StringIO()
    backend = Scripted([(0.0, RankExit(0, 0, 1, 100, t))], stuck=[Stuck(2, 0, 102, "T")])
    out = supervise(plan_of(), backend, OutputSink(stdout=io.StringIO(), stderr=err))
    assert out.code == 1 and out.stuck == (Stuck(2, 0, 102, "T"),)
    lines = notes(err)
    assert lines[0] == ("rank 2 on host localhost (pid 102) is stopped (state T, SIGSTOP?): it "
                        "is the likely cause; rank 0 failed waiting for it")
    assert lines[1].startswith("rank 0 on host localhost (pid 100) exited with code 1")


def test_timeout_names_stopped_ranks_first():
    err = io.StringIO()
    backend = Scripted([], stuck=[Stuck(1, 0, 101, "t")])
    out = supervise(plan_of(2), backend, OutputSink(stdout=io.StringIO(), stderr=err),
                    timeout=0.3)
    assert out.code == 124
    lines = notes(err)
    assert lines[0] == ("rank 1 on host localhost (pid 101) is stopped by a debugger (state t): "
                        "it is the likely cause")
    assert lines[1].startswith("--timeout 0.3s reached; ranks still running: 0 (localhost), 1")


def test_success_prints_no_summary():
    t = time.monotonic()
    err = io.StringIO()
    script = [(0.0, RankExit(r, 0, 0, 100 + r, t)) for r in range(3)]
    assert supervise(plan_of(), Scripted(script), OutputSink(stderr=err)).code == 0
    assert err.getvalue() == ""


# ------------------------------------------------------------------ the agent protocol
class AgentsHere(AgentBackend):
    """The ssh backend's protocol with every "host" an agent on this host: what travels to
    the ranks is the JSON spec on the agent's stdin, exactly as over ssh."""

    name = "agents-here"

    def transport(self, host, connect_timeout=None):
        return []

    def fix_hint(self, host):
        return "(local agent)"


def run_agents(marker, program, nhosts=2, per_host=2, timeout=30):
    hosts = tuple(HostSpec(f"h{i}", per_host) for i in range(nhosts))
    plan = plan_of(program=program, hosts=hosts, secret=f"agent-secret-{marker}")
    out, err = io.StringIO(), io.StringIO()
    backend = AgentsHere(LaunchOptions(grace=2.0))
    t0 = time.monotonic()
    outcome = supervise(plan, backend, OutputSink(stdout=out, stderr=err), timeout=timeout)
    return outcome, out.getvalue(), err.getvalue(), time.monotonic() - t0, backend


def test_secret_reaches_ranks_through_the_agent_spec_never_argv(marker):
    outcome, out, err, _, backend = run_agents(marker, (PY, WORKER, "env", marker))
    assert outcome.code == 0, err
    envs = [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines()]
    assert len(envs) == 4
    assert {e["DDL_JOB_SECRET"] for e in envs} == {f"agent-secret-{marker}"}
    assert not any(e["secret_in_argv"] for e in envs)  # neither the rank's nor the agent's
    spec = backend.spec(backend.plan, backend.plan.hosts[1])
    assert {r["env"]["DDL_JOB_SECRET"] for r in spec["ranks"]} == {f"agent-secret-{marker}"}
    assert all(f"agent-secret-{marker}" not in " ".join(c) for c in backend.commands(
        backend.plan))
    assert wait_gone(marker) == []


def test_agent_names_a_stopped_rank_on_another_host_first(marker):
    # rank 3 (host 1) stops itself; rank 0 (host 0) fails a second later "waiting for it"
    outcome, _, err, took, _ = run_agents(marker, (PY, WORKER, "stopfail", marker, "3", "0"))
    assert outcome.code == 1, err
    first = next(ln for ln in err.splitlines() if re.match(r"ddlrun: rank \d", ln))
    assert re.match(r"ddlrun: rank 3 on host h1 \(pid \d+\) is stopped \(state T, SIGSTOP\?\): "
                    r"it is the likely cause; rank 0 failed waiting for it$", first), err
    assert took < 15
    assert wait_gone(marker) == []


def test_agent_exit_with_a_child_holding_stdout_is_reported_at_once(marker):
    # rank 0 leaves a child holding its stdout (a data-loader worker) and exits 5
    outcome, _, err, took, _ = run_agents(marker, (PY, WORKER, "grandchild", marker), 2, 2)
    assert (outcome.code, outcome.failure.rank) == (5, 0), err
    assert took < 10
    assert wait_gone(marker) == []


def test_agent_exit_times_order_exits_not_their_arrival():
    plan = plan_of(program=("p",), hosts=(HostSpec("h0", 1), HostSpec("h1", 1)))
    got = []
    backend = AgentsHere(LaunchOptions())
    backend.plan, backend.sink, backend.emit = plan, OutputSink(stderr=io.StringIO()), got.append
    backend._lock = threading.Lock()
    backend._changed = threading.Condition(backend._lock)
    backend.exited, backend._eof, backend._stuck = {0: set(), 1: set()}, set(), {}
    now = time.time()
    backend._on_line(0, "stdout", json.dumps({"t": "exit", "r": 0, "c": 1, "p": 9, "w": now}))
    backend._on_line(1, "stdout", json.dumps({"t": "exit", "r": 1, "c": 3, "p": 8,
                                              "w": now - 0.5}))
    assert [e.rank for e in sorted(got, key=lambda e: e.time)] == [1, 0]
    assert 0.4 < got[0].time - got[1].time < 0.6
    backend._on_line(1, "stdout", json.dumps({"t": "stuck", "s": {"1": [8, "T"]}}))
    assert backend._stuck == {1: [Stuck(1, 1, 8, "T")]}
