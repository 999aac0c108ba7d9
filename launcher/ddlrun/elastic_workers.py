"""Where an elastic job's workers run, and what becomes of them: workers on ddlrun's own
host are its children (a process set); a remote host's workers are started by an agent
over ssh (``ddlrun.agent`` with ``"elastic": true``: a worker's failure does not stop the
others), one agent per batch of workers started there. Every exit comes back as a
``WorkerExit`` (with the worker's failure record when it wrote one); an agent whose
connection ends before all its workers reported (the host died, its agent was killed, the
network went) is a ``HostGone`` naming the workers it took with it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from . import envs
from .backends.base import LaunchOptions
from .backends.ssh import SshBackend
from .failures import FailureRecord, RecordFolder, read_record
from .hosts import HostSpec, is_local
from .output import OutputSink
from .procs import Exit, ProcessSet, ProcSpec


@dataclass(frozen=True)
class WorkerExit:
    key: int
    code: int  # negative: the signal that killed it
    record: FailureRecord | None = None
    error: str | None = None  # its program could not be started (the OS's words)


@dataclass(frozen=True)
class HostGone:
    host: str
    keys: tuple[int, ...]  # the workers it took with it
    why: str


Event = WorkerExit | HostGone


def is_here(host: str) -> bool:
    return is_local(host, {socket.gethostname()})


def source_address(hosts: Sequence[str], known: Mapping[str, str | None]) -> str:
    """The address of this host that the remote ``hosts`` reach it by (the route to the
    first one: its address from preflight, else its name); 127.0.0.1 when all are here.
    ddlrun's store binds it alone, never the wildcard."""
    remote = [h for h in hosts if not is_here(h)]
    if not remote:
        return "127.0.0.1"
    target = known.get(remote[0]) or remote[0].strip("[]")
    try:
        family, _, _, _, addr = socket.getaddrinfo(target, 22, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)  # no packet is sent: the kernel picks the route's source
            return probe.getsockname()[0]
    except OSError as exc:
        raise OSError(f"cannot tell which address of this host {remote[0]} reaches "
                      f"({exc.strerror or exc}); give --network-interface") from None


class _Agent:
    """One agent on a remote host, running some of the job's workers."""

    def __init__(self, host: str, keys: Sequence[int], workers: Workers) -> None:
        self.host, self.keys, self.workers = host, tuple(keys), workers
        self.exited: set[int] = set()
        self.last_err = ""
        self.procs = ProcessSet(self._on_line, self._on_exit)

    def start(self, argv: Sequence[str], spec: dict, timeout: float) -> None:
        self.procs.start([ProcSpec(0, tuple(argv), dict(os.environ), None, stdin_pipe=True,
                                   max_line=None)])
        data = json.dumps(spec, separators=(",", ":")) + "\n"
        self.procs.write(0, data.encode(), timeout=timeout)

    def send(self, msg: dict) -> None:
        if self.procs.running():
            self.procs.write(0, (json.dumps(msg) + "\n").encode(), timeout=1.0)

    def _on_line(self, _key: int, stream: str, text: str) -> None:
        if stream == "stderr":
            self.last_err = text.rstrip()
            self.workers.sink.note(f"{self.host}: {text.rstrip()}")
            return
        try:
            msg = json.loads(text)
            kind = msg["t"]
        except (ValueError, KeyError, TypeError):
            if text.strip():
                self.workers.sink.note(f"{self.host}: {text.rstrip()}")
            return
        if kind == "line":
            self.workers.sink.line(int(msg["r"]), msg["s"], msg["d"])
        elif kind == "exit":
            key = int(msg["r"])
            self.exited.add(key)
            self.workers.events.put(WorkerExit(key, int(msg["c"]),
                                               FailureRecord.from_json(msg.get("e"))))
        elif kind == "error":
            self.last_err = str(msg.get("m"))

    def _on_exit(self, ex: Exit) -> None:
        missing = tuple(k for k in self.keys if k not in self.exited)
        if ex.error is not None:
            why = f"cannot start {ex.error.filename}: {ex.error.strerror}"
        else:
            why = self.last_err or f"its connection ended with code {ex.code}"
        if missing:
            self.workers.events.put(HostGone(self.host, missing, why))


class Workers:
    """The job's workers on every host; ``events`` gets their exits and lost hosts."""

    def __init__(self, sink: OutputSink, opts: LaunchOptions, records: RecordFolder,
                 cwd: str | None) -> None:
        self.sink, self.opts, self.records, self.cwd = sink, opts, records, cwd
        self.events: queue.Queue[Event] = queue.Queue()
        self.local = ProcessSet(sink.line, self._local_exit)
        self.agents: list[_Agent] = []
        self.jobs: list[str] = []
        self._lock = threading.Lock()

    def _local_exit(self, ex: Exit) -> None:
        if ex.error is not None:
            self.events.put(WorkerExit(ex.key, 127, None, ex.error.strerror))
            return
        record = read_record(self.records.path(ex.key)) if ex.code != 0 else None
        self.events.put(WorkerExit(ex.key, ex.code, record))

    def start(self, host: str, workers: Sequence[tuple[int, Sequence[str], Mapping[str, str]]],
              job_id: str) -> None:
        """Start ``(key, argv, env)`` workers on ``host`` (``env``: the launch variables;
        ddlrun's own environment under them for workers here)."""
        if not workers:
            return
        if is_here(host):
            base = dict(os.environ)
            self.local.start(
                ProcSpec(key, tuple(argv),
                         {**base, envs.DDL_ERROR_FILE: self.records.path(key), **env}, self.cwd)
                for key, argv, env in workers)
            return
        backend = SshBackend(self.opts)
        spec = self._spec(job_id, [{"rank": key, "argv": list(argv), "env": dict(env)}
                                   for key, argv, env in workers])
        agent = _Agent(host, [key for key, _, _ in workers], self)
        with self._lock:
            self.agents.append(agent)
        agent.start(backend.get_cmd(HostSpec(host)), spec, self.opts.start_timeout)
        agent.send({"t": "jobs", "jobs": list(self.jobs)})

    def stop(self, keys: Sequence[int]) -> None:
        """Stop these workers (they never took part in a world: nothing of theirs is lost):
        the local ones by SIGTERM, a remote one's whole agent (it was started for one
        batch of new workers, all of which are stopped together)."""
        wanted = set(keys)
        for key in wanted:
            self.local.signal_one(key, signal.SIGTERM)
        with self._lock:
            agents = [a for a in self.agents if wanted & set(a.keys)]
        for agent in agents:
            agent.send({"t": "stop"})

    def _spec(self, job_id: str, ranks: list[dict], **extra: object) -> dict:
        """An elastic agent's job spec (agent.py): its workers' ``ranks``."""
        return {"job_id": job_id, "host_index": 0, "grace": self.opts.grace,
                "cwd": self.cwd or os.getcwd(), "elastic": True, "ranks": ranks, **extra}

    def new_world(self, job_id: str) -> None:
        """A new world's job id: every agent removes its shared memory at its end too."""
        self.jobs.append(job_id)
        with self._lock:
            agents = list(self.agents)
        for agent in agents:
            agent.send({"t": "jobs", "jobs": [job_id]})

    def sweep(self, hosts: Sequence[str], secret_env: Mapping[str, str]) -> None:
        """Remove what the job left on ``hosts`` whose agent was lost (the host may be up:
        its agent was killed): an agent with no workers, told every world's job id, which
        cleans up and ends. A host that cannot be reached is left (the next ddlrun that
        starts there sweeps what no process maps)."""
        sweepers = []
        for host in hosts:
            if is_here(host) or not self.jobs:
                continue
            spec = self._spec(self.jobs[0], [], env=dict(secret_env))
            agent = _Agent(host, [], self)
            agent.start(SshBackend(self.opts).get_cmd(HostSpec(host)), spec,
                        self.opts.start_timeout)
            agent.send({"t": "jobs", "jobs": list(self.jobs)})
            agent.send({"t": "stop"})
            sweepers.append(agent)
        deadline = time.monotonic() + self.opts.start_timeout + 2.0
        while any(a.procs.running() for a in sweepers) and time.monotonic() < deadline:
            time.sleep(0.05)
        for agent in sweepers:
            agent.procs.close(timeout=1.0)

    def close(self, grace: float) -> None:
        """Stop every worker: the agents by message (then their connection's end), the
        local ones by signal."""
        with self._lock:
            agents = list(self.agents)
        for agent in agents:
            agent.send({"t": "stop"})
        try:
            self.local.close(timeout=grace)
        finally:
            deadline = time.monotonic() + grace + 2.0  # the agents' own grace, plus transit
            while any(a.procs.running() for a in agents) and time.monotonic() < deadline:
                time.sleep(0.05)
            for agent in agents:
                agent.procs.close(timeout=2.0)
