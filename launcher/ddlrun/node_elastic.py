"""One ddlrun per node, torchrun's elastic way: ``--nnodes MIN:MAX`` and ``--max-restarts``
with ``--rdzv-endpoint`` (torchrun's elastic agent, ``torch/distributed/elastic/agent``).

Each ddlrun is its node's agent. The one whose host is the endpoint's serves the
rendezvous store there (guarded by the job's secret when there is one); every agent joins
each round (:mod:`ddlrun.node_rdzv`), starts its node's ranks for it, and watches it:

- its ranks end well: the agent waits (up to ``close_timeout``) for the other nodes at an
  exit barrier, then exits 0;
- one of its ranks fails: the usual report names that rank (code, last lines); while the
  job has restarts left (``--max-restarts``, counted over the whole job, as one failure
  restarts every node) the agent opens the next round, and every node stops and starts
  again through it (``TORCHELASTIC_RESTART_COUNT`` counts); without, it closes the job and
  every node's ddlrun exits with that rank's code, saying which node failed;
- its ranks only failed because a peer did (a lost peer, or another node's failure that
  moved the rendezvous on): it waits for the node that caused it to act, and follows;
  if nobody acts (that node's ddlrun died with its host), it counts the failure itself;
- a node comes while the round has fewer than MAX nodes: the members stop their ranks and
  the next round includes it (no restart is used). A node that comes to a full round waits.

Round ``N``'s ranks are job ``<run id>.r<N>`` (run id: ``--rdzv-id``, else one the first
node drew), so each start has its own shared memory and ddl rendezvous, on the port node 0
picks free.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from . import core
from . import node_rdzv as rdzv
from .backends import get_backend
from .config import Config, NodeRendezvous
from .events import RankExit, Superseded, describe_code
from .failures import ROOT, tier
from .output import OutputSink
from .plan import Attempt, HostFacts, make_plan
from .plan_types import attempt_job_id
from .preflight import pick_free_pair
from .run import Interrupted, Outcome, signals_deferred, signals_raise
from .shm import job_secret
from .steps import JobInputs, new_job_id, run_attempt, sweep_at_start

WATCH = 0.5  # seconds between the watcher's looks at the rendezvous while ranks run
FOLLOW = 15.0  # seconds a node whose ranks failed because of a peer waits for its node


class _Node:
    def __init__(self, cfg: Config, facts: Mapping[str, HostFacts], inputs: JobInputs,
                 sink: OutputSink, environ: Mapping[str, str]) -> None:
        assert cfg.rendezvous is not None
        self.cfg, self.facts, self.inputs, self.sink = cfg, facts, inputs, sink
        self.environ = environ
        self.rz: NodeRendezvous = cfg.rendezvous
        self.secret = job_secret(dict(inputs.secret_env))
        self.me = f"{socket.gethostname()}:{os.getpid()}"
        self.server: Any = None
        self.store: Any = None
        self.serving = False

    # ---------------------------------------------------------------- the store
    def open_store(self) -> None:
        """Serve the store when the endpoint is this host's and its port is free here;
        otherwise reach the one that serves it (retrying until the join timeout)."""
        lib = core.require(core.rendezvous(), "the rendezvous of one ddlrun per node")
        errors = core.require(core.errors(), "the rendezvous of one ddlrun per node")
        host, port = self.rz.host, self.rz.port
        try:
            addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
        except OSError as exc:
            raise OSError(f"--rdzv-endpoint {host}: {exc.strerror or exc}") from None
        try:
            self.server = lib.StoreServer(addr, port, self.secret,
                                          timeout=self.rz.join_timeout)
            self.serving = True
        except (OSError, errors.DDLConfigError):  # not this host's address, or another
            self.server = None  # ddlrun here serves it (PortInUse): reach that one
        self.store = lib.StoreClient(addr, port, self.secret, rank=-1,
                                     timeout=self.rz.join_timeout)
        if self.serving:
            self.sink.note(f"rendezvous: serving {host}:{port} for the job's nodes"
                           + ("" if self.secret else " (no DDL_JOB_SECRET: open to anyone "
                              "who reaches it)"))

    def run_id(self) -> str:
        """The id every node's rounds share: --rdzv-id, else the first node's draw."""
        if self.cfg.job_id:
            return self.cfg.job_id
        self.store.compare_set("run_id", b"", new_job_id().encode())
        return self.store.get("run_id").decode()

    def master(self, rnd: rdzv.Round) -> tuple[str, int]:
        """Where round ``rnd``'s ranks meet: node 0 picks a free port on its address that
        routes to the endpoint and publishes it; the others read it."""
        key = f"master/{rnd.number}"
        if rnd.node_rank == 0:
            addr = _route_to(self.rz.host, self.rz.port)
            port = pick_free_pair()
            self.store.set(key, f"{addr} {port}".encode())
            return addr, port
        addr, port = self.store.get(key, self.rz.join_timeout).decode().split()
        return addr, int(port)

    # ----------------------------------------------------------------- a round
    def run_round(self, rnd: rdzv.Round, run_id: str, deadline: float | None) -> Outcome:
        addr, port = self.master(rnd)
        cfg = self.cfg
        request = replace(cfg.request, nnodes=rnd.nnodes, node_rank=rnd.node_rank,
                          master_addr=addr)
        plan = make_plan(request, self.facts, attempt_job_id(run_id, rnd.number), port,
                         self.environ, self.inputs.secret_env, export_job_id=True,
                         attempt=Attempt(rnd.failures, cfg.max_restarts, run_id))
        ranks = [r.rank for r in plan.ranks]
        world = len(plan.ranks) * rnd.nnodes
        self.sink.note(f"round {rnd.number}: {rnd.nnodes} node(s), this is node "
                       f"{rnd.node_rank} with ranks {ranks[0]}-{ranks[-1]} of {world} "
                       f"(job {plan.job_id}, restarts used {rnd.failures} of "
                       f"{cfg.max_restarts})")
        events: queue.Queue = queue.Queue()
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(rnd, events, stop),
                                   name="ddlrun-rdzv-watch", daemon=True)
        watcher.start()
        try:
            return run_attempt(cfg, plan, get_backend(cfg.launcher, cfg.options), self.sink,
                               deadline, events)
        finally:
            stop.set()
            watcher.join(5)

    def _watch(self, rnd: rdzv.Round, events: queue.Queue, stop: threading.Event) -> None:
        while not stop.wait(WATCH):
            try:
                why = rdzv.watch(self.store, rnd, self.rz.max_nodes)
            except Exception as exc:  # noqa: BLE001 - the store is gone: say so, stop
                why = f"lost the rendezvous at {self.rz.host}:{self.rz.port} ({exc})"
            if why is not None:
                events.put(Superseded(why, time.monotonic()))
                return

    # ------------------------------------------------------------------ the job
    def run(self) -> int:
        cfg, rz = self.cfg, self.rz
        deadline = time.monotonic() + cfg.timeout if cfg.timeout else None
        self.open_store()
        run_id = self.run_id()
        after = -1
        while True:
            rnd = rdzv.join(self.store, self.me, rz.min_nodes, rz.max_nodes,
                            timeout=rz.join_timeout, last_call=rz.last_call, after=after)
            after = rnd.number
            outcome = self.run_round(rnd, run_id, deadline)
            if isinstance(outcome.failure, Superseded):
                if outcome.late_signal is not None:
                    return self.end(128 + outcome.late_signal, "ddlrun was stopped")
                continue
            if outcome.code == 0:
                return self.finished(rnd)
            failure = outcome.failure
            if outcome.late_signal is not None or not isinstance(failure, RankExit):
                why = ("ddlrun was stopped" if outcome.late_signal is not None
                       else f"node {rnd.node_rank} ({self.me}) ended with code {outcome.code}")
                return self.end(outcome.code, why)
            line = (f"rank {failure.rank} on node {rnd.node_rank} ({self.me}) "
                    f"{describe_code(failure.code)}")
            if tier(failure.record, failure.code) != ROOT:
                if self.follow(rnd):
                    continue  # the node that caused it moved the job on (follow says so)
                line = (f"{line} because of a peer, and no other node acted within "
                        f"{FOLLOW:g} s (a node lost with its ddlrun?)")
            st = rdzv.read(self.store) or {}
            if st.get("phase") == "closed":
                raise rdzv.RendezvousClosed(st.get("end") or {})
            if st.get("round") != rnd.number:  # another node acted first: follow it
                self._moved_on(st)
                continue
            if int(st.get("failures", 0)) >= cfg.max_restarts or self.someone_done(rnd):
                why = (f"{line}; no restart left (--max-restarts {cfg.max_restarts})"
                       if not self.someone_done(rnd) else
                       f"{line} after a node had finished: no restart")
                code = self.end(outcome.code, why, rnd.number)
                if code is not None:
                    return code
                continue  # another node moved the job on meanwhile
            if deadline is not None and time.monotonic() >= deadline:
                code = self.end(outcome.code, f"{line}; --timeout used up: no restart",
                                rnd.number)
                if code is not None:
                    return code
                continue
            st = rdzv.next_round(self.store, rnd.number, failed=True, why=line)
            if st.get("phase") == "closed":
                raise rdzv.RendezvousClosed(st.get("end") or {})
            if st.get("why") == line:
                self.sink.note(f"{line}; restart {st.get('failures')} of "
                               f"{cfg.max_restarts}: every node starts again")
            else:
                self._moved_on(st)

    def follow(self, rnd: rdzv.Round) -> bool:
        """This node's ranks failed because of a peer: wait for the node whose rank caused
        it to move the job on (True) or close it (``RendezvousClosed``); False when
        nobody did within ``FOLLOW`` seconds (its ddlrun is gone too)."""
        end = time.monotonic() + FOLLOW
        while time.monotonic() < end:
            st = rdzv.read(self.store) or {}
            if st.get("phase") == "closed":
                raise rdzv.RendezvousClosed(st.get("end") or {})
            if st.get("round") != rnd.number:
                self._moved_on(st)
                return True
            time.sleep(0.1)
        return False

    def _moved_on(self, st: dict[str, Any]) -> None:
        self.sink.note(f"this node's ranks failed because of a peer; round {st.get('round')} "
                       "began" + (f": {st['why']}" if st.get("why") else ""))

    def someone_done(self, rnd: rdzv.Round) -> bool:
        return self.store.check([f"done/{rnd.number}"]) and \
            self.store.add(f"done/{rnd.number}", 0) > 0

    def finished(self, rnd: rdzv.Round) -> int:
        """This node's ranks all ended well: wait at the exit barrier for the other nodes
        (``close_timeout``), as torchrun's agents do, then exit 0."""
        done = self.store.add(f"done/{rnd.number}", 1)
        end = time.monotonic() + self.rz.close_timeout
        while done < rnd.nnodes and time.monotonic() < end:
            st = rdzv.read(self.store) or {}
            if st.get("phase") == "closed" or st.get("round") != rnd.number:
                break
            time.sleep(0.1)
            done = self.store.add(f"done/{rnd.number}", 0)
        if done >= rnd.nnodes:
            rdzv.close(self.store, 0, "every node finished")
        return 0

    def end(self, code: int, why: str, number: int | None = None) -> int | None:
        """Close the job for every node, say why, return ``code``; None when another node
        moved round ``number`` on first (this node follows it)."""
        st = rdzv.close(self.store, code, why, number)
        if st.get("phase") != "closed":
            return None
        end = st.get("end") or {}
        if end.get("why") != why:  # another node closed it first
            raise rdzv.RendezvousClosed(end)
        self.sink.note(f"job ended: {why}")
        return code

    def close(self) -> None:
        """Close the store; the node serving it first gives the others ``close_timeout``
        to read how the job ended (each says it left)."""
        try:
            if self.store is not None:
                self.store.add("left", 1)
                if self.serving:
                    end = time.monotonic() + self.rz.close_timeout
                    while time.monotonic() < end and self._others_here():
                        time.sleep(0.1)
                self.store.close()
        except Exception:  # noqa: BLE001, S110 - the store's ddlrun is gone: nothing to close
            pass
        finally:
            if self.server is not None:
                self.server.close()

    def _others_here(self) -> bool:
        st = rdzv.read(self.store) or {}
        members = set(st.get("nodes", ())) | set(st.get("waiting", ()))
        return self.store.add("left", 0) < len(members)


def _route_to(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (127.0.0.1 when it is here)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(addr)  # no packet is sent: the kernel picks the route's source
        return probe.getsockname()[0]


def run_node_elastic(cfg: Config, facts: Mapping[str, HostFacts], inputs: JobInputs,
                     sink: OutputSink, environ: Mapping[str, str]) -> int:
    """Run this node's part of a torchrun-style elastic job to its end; its exit code."""
    sweep_at_start(sink)
    node = _Node(cfg, facts, inputs, sink, environ)
    try:
        with signals_raise():
            try:
                return node.run()
            finally:
                with signals_deferred():
                    node.close()
    except rdzv.RendezvousClosed as exc:
        sink.note(f"job ended: {exc.why}")
        return exc.code
    except rdzv.RendezvousTimeout as exc:
        sink.note(f"rendezvous: {exc}")
        return 1
    except Interrupted as exc:
        sink.note(f"{signal.Signals(exc.signum).name}: this node's ranks were stopped")
        return 128 + exc.signum
    except OSError as exc:
        sink.note(f"rendezvous: {exc}")
        return 1
    except Exception as exc:  # the store's errors (ddl's): its ddlrun and host are gone
        if type(exc).__module__.startswith("ddl"):
            sink.note(f"rendezvous: lost the store at {cfg.rendezvous.host}:"
                      f"{cfg.rendezvous.port}: {exc}")
            return 1
        raise
    finally:
        sink.close()

