"""ssh backend: one connection per host, each running the per-host agent
(``python -m ddlrun.agent``), which starts that host's ranks. The job spec (argv and env of
every rank) travels as JSON on the connection's stdin, never on a command line.

``AgentBackend`` holds the protocol; ``SshBackend`` (and ``LsfBackend``, over blaunch) only
say how to reach a host in ``get_cmd()``.
"""

from __future__ import annotations

import json
import os
import shlex
import threading
import time
from collections.abc import Sequence

from ..events import Emit, HostLost, RankExit, StartFailed, Stuck
from ..failures import FailureRecord
from ..hosts import HostSpec
from ..output import OutputSink
from ..plan import HostPlan, JobPlan
from ..procs import Exit, ProcessSet, ProcSpec
from ..shm import mib
from .base import Backend, check_path, ssh_options

AGENT_MODULE = "ddlrun.agent"


class AgentBackend(Backend):
    """Start ``python -m ddlrun.agent`` on every host and speak its JSON-lines protocol."""

    # exits of other hosts reach us through ssh, behind their output: listen longer
    settle = 1.0

    def transport(self, host: HostSpec, connect_timeout: float | None = None) -> list[str]:
        raise NotImplementedError

    def remote(self, *args: str) -> list[str]:
        python = check_path(self.opts.remote_python, "--remote-python")
        return [python, "-m", AGENT_MODULE, *args]

    def get_cmd(self, host: HostSpec) -> list[str]:
        return self.transport(host) + self.remote()

    def probe_cmd(self, host: HostSpec, ports: Sequence[int], iface: str | None,
                  python: str | None = None) -> list[str]:
        args = ["--probe"]
        for port in ports:
            args += ["--port", str(int(port))]
        if iface:
            args += ["--iface", iface]
        if python:
            args += ["--python", check_path(python, "the program's python")]
        return self.transport(host, self.opts.start_timeout) + self.remote(*args)

    def commands(self, plan: JobPlan) -> list[list[str]]:
        return [self.get_cmd(h.host) for h in plan.hosts]

    def spec(self, plan: JobPlan, host: HostPlan) -> dict:
        return {
            "job_id": plan.job_id,
            "host_index": host.index,
            "grace": self.opts.grace,
            "cwd": self.opts.cwd or os.getcwd(),
            "ranks": [
                {"rank": r.rank, "argv": list(r.argv), "env": r.env_dict()} for r in host.ranks
            ],
        }

    # ------------------------------------------------------------------ run
    def start(self, plan: JobPlan, sink: OutputSink, emit: Emit) -> None:
        self.plan, self.sink, self.emit = plan, sink, emit
        self._lock = threading.Lock()
        self.exited: dict[int, set[int]] = {h.index: set() for h in plan.hosts}
        self.done: set[int] = set()
        self.last_err: dict[int, str] = {}
        self.rank_pids: dict[int, int] = {}
        self._changed = threading.Condition(self._lock)
        self._eof: set[int] = set()
        self._stuck: dict[int, list[Stuck]] = {}  # host index -> its agent's first answer
        self.procs = ProcessSet(self._on_line, self._on_exit)
        env = dict(os.environ)
        # the agent cuts its ranks' long lines itself; its own messages must stay whole
        self.procs.start(
            ProcSpec(h.index, tuple(self.get_cmd(h.host)), env, None, stdin_pipe=True,
                     max_line=None)
            for h in plan.hosts
        )
        for h in plan.hosts:  # an agent that cannot take its spec in time is lost
            data = json.dumps(self.spec(plan, h), separators=(",", ":")) + "\n"
            self.procs.write(h.index, data.encode(), timeout=self.opts.start_timeout)

    def _on_line(self, host_index: int, stream: str, text: str) -> None:
        host = self.plan.hosts[host_index].host.name
        if stream == "stderr":
            self.last_err[host_index] = text.rstrip()
            self.sink.note(f"{host}: {text.rstrip()}")
            return
        try:
            msg = json.loads(text)
            kind = msg["t"]
        except (ValueError, KeyError, TypeError):
            if text.strip():
                self.sink.note(f"{host}: {text.rstrip()}")
            return
        if kind == "line":
            self.sink.line(int(msg["r"]), msg["s"], msg["d"])
        elif kind == "exit":
            rank = int(msg["r"])
            with self._lock:
                self.exited[host_index].add(rank)
            self.emit(RankExit(rank, host_index, int(msg["c"]), int(msg["p"]),
                               _when(msg.get("w")), FailureRecord.from_json(msg.get("e"))))
        elif kind == "eof":
            with self._changed:
                self._eof.add(int(msg["r"]))
                self._changed.notify_all()
        elif kind == "stuck":
            # [pid, state, starting] ([pid, state] from older agents)
            found = [Stuck(int(r), host_index, int(v[0]), str(v[1]), bool(v[2:3] and v[2]))
                     for r, v in dict(msg.get("s", {})).items()]
            with self._changed:
                self._stuck.setdefault(host_index, sorted(found, key=lambda s: s.rank))
                self._changed.notify_all()
        elif kind == "swept":
            self.sink.note(f"{host}: removed {msg.get('n')} orphaned shared-memory segment(s) "
                           f"of killed jobs ({mib(int(msg.get('bytes', 0)))})")
        elif kind == "started":
            self.rank_pids.update({int(k): int(v) for k, v in msg["pids"].items()})
        elif kind == "error":
            self.last_err[host_index] = str(msg.get("m"))
            self.sink.note(f"{host}: {msg.get('m')}")
        elif kind == "done":
            with self._lock:
                self.done.add(host_index)

    def _on_exit(self, ex: Exit) -> None:
        hp = self.plan.hosts[ex.key]
        with self._changed:
            missing = len(hp.ranks) - len(self.exited[ex.key])
            self._stuck.setdefault(ex.key, [])  # nobody left there to answer
            self._eof.update(r.rank for r in hp.ranks)
            self._changed.notify_all()
        if ex.error is not None:  # the transport (ssh, blaunch) could not be exec'd
            self.emit(StartFailed(ex.error.filename, ex.error.strerror, ex.time))
        elif missing > 0:
            why = self.last_err.get(ex.key) or f"connection exited with code {ex.code}"
            self.emit(HostLost(ex.key, ex.code, f"agent on {hp.host.name} ended: {why}",
                               ex.time))

    def stuck(self, timeout: float) -> list[Stuck]:
        """Ask every agent that has not said yet; an agent answers before its own teardown
        too (that answer is kept: the teardown continues stopped ranks)."""
        procs = getattr(self, "procs", None)
        if procs is None:
            return []
        deadline = time.monotonic() + timeout
        with self._lock:
            asked = [h.index for h in self.plan.hosts if h.index not in self._stuck]
        for index in asked:
            left = max(0.0, deadline - time.monotonic())
            if not procs.write(index, b'{"t":"stuck"}\n', timeout=left):
                with self._lock:
                    self._stuck.setdefault(index, [])
        with self._changed:
            self._changed.wait_for(lambda: all(h.index in self._stuck for h in self.plan.hosts),
                                   max(0.0, deadline - time.monotonic()))
            return [s for h in self.plan.hosts for s in self._stuck.get(h.index, ())]

    def wait_output(self, rank: int, timeout: float) -> None:
        if getattr(self, "procs", None) is None:
            return
        with self._changed:
            self._changed.wait_for(lambda: rank in self._eof, timeout)

    def close(self, timeout: float) -> None:
        procs = getattr(self, "procs", None)
        if procs is None:
            return
        stop = b'{"t":"stop"}\n'
        for key in procs.running():
            procs.write(key, stop, timeout=1.0)
        deadline = time.monotonic() + timeout + 2.0  # the agent's own grace, plus transit
        while procs.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        # Still there: closing stdin (EOF) and then signals make the agents tear down.
        procs.close(timeout=2.0)


def _when(wall: float | None) -> float:
    """An agent's wall-clock exit time on our monotonic clock (hosts' clocks agree to NTP
    precision; one ahead of ours counts as now, i.e. the time we heard of it)."""
    now = time.monotonic()
    if wall is None:
        return now
    return now - max(0.0, time.time() - float(wall))


class SshBackend(AgentBackend):
    name = "ssh"

    def transport(self, host: HostSpec, connect_timeout: float | None = None) -> list[str]:
        o = self.opts
        argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5",
                "-o", "ServerAliveCountMax=3"]
        timeout = connect_timeout or o.start_timeout
        argv += ["-o", f"ConnectTimeout={max(1, int(timeout))}"]
        argv += ssh_options(o)
        if host.user:
            argv += ["-l", host.user]
        # "--" ends ssh's options: the (validated) host can never be read as one.
        return [*argv, "--", host.name]

    def remote(self, *args: str) -> list[str]:
        # ssh hands the remote command to the remote shell: quote every word.
        return [shlex.join(super().remote(*args))]

    def fix_hint(self, host: HostSpec) -> str:
        port = f" -p {self.opts.ssh_port}" if self.opts.ssh_port else ""
        return (f"check that `ssh{port} {host.destination} true` works without a password "
                "and the host key is known")
