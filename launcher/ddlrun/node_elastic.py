"""One ddlrun per node, torchrun's elastic way: ``--nnodes MIN:MAX`` and ``--max-restarts``
with ``--rdzv-endpoint`` (torchrun's elastic agent, ``torch/distributed/elastic/agent``).

Each ddlrun is its node's agent. The one whose host is the endpoint's serves the
rendezvous store there (guarded by the job's secret when there is one); every agent joins
each round (:mod:`ddlrun.node_rdzv`), starts its node's ranks for it, and watches it:

- its ranks end well: the agent waits (up to 300 s, torchrun's) for the other nodes at an
  exit barrier, then exits 0; the agent serving the store stays until every node has left;
- one of its ranks fails: the usual report names that rank (code, last lines); while the
  job has restarts left (``--max-restarts``, counted over the whole job, as one failure
  restarts every node) the agent opens the next round, and every node stops and starts
  again through it (``TORCHELASTIC_RESTART_COUNT`` counts); without, it closes the job and
  every node's ddlrun exits with that rank's code, saying which node failed;
- its ranks only failed because a peer did (a lost peer, or another node's failure that
  moved the rendezvous on): it waits for the node that caused it to act, and follows (the
  node whose rank failed of its own accord publishes that at once, before its teardown);
  if nobody acts (that node's ddlrun died with its host), it counts the failure itself;
- ddlrun itself gets a signal (preemption): only this node stops, and the rendezvous stays
  open, as torchrun's does; the others restart without it while MIN nodes remain;
- a node comes while the round has fewer than MAX nodes: the members stop their ranks and
  the next round includes it (no restart is used). A node that comes to a full round waits.

Round ``N``'s ranks are job ``<run id>.r<N>`` (run id: ``--rdzv-id``, else one the first
node drew), so each start has its own shared memory and ddl rendezvous, on the port node 0
picks free.
"""

from __future__ import annotations

import ipaddress
import json
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
from .preflight import interface_address, pick_free_pair
from .run import Interrupted, Outcome, exit_code, signals_deferred, signals_raise
from .shm import job_secret
from .steps import JobInputs, new_job_id, run_attempt, sweep_at_start

WATCH = 0.5  # seconds between the watcher's looks at the rendezvous while ranks run
FOLLOW = 15.0  # seconds a node whose ranks failed because of a peer waits for a cause
# while every member's heartbeat still moves (one that stops for node_rdzv.STALE is lost)
EXIT_BARRIER = 300.0  # torchrun's: how long a finished node waits for the others
MASTER_WAIT = 60.0  # seconds the other nodes wait for node 0 to say where ranks meet


class _Events(queue.Queue):
    """The supervisor's channel for one round, which also publishes the round's first cause
    (a rank of this node that failed of its own accord) at once, before the teardown and
    report, so that the nodes whose ranks failed because of it wait for this node rather
    than count the failure themselves."""

    def __init__(self, node: _Node, rnd: rdzv.Round) -> None:
        super().__init__()
        self.node, self.rnd = node, rnd

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, RankExit) and item.code and tier(item.record, item.code) == ROOT:
            try:
                self.node.publish_cause(self.rnd, item)
            except Exception:  # noqa: BLE001, S110 - the store is gone: the failure still counts
                pass
        super().put(item, block, timeout)


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
        self.errors = core.require(core.errors(), "the rendezvous of one ddlrun per node")

    # ---------------------------------------------------------------- the store
    def open_store(self) -> None:
        """Serve the store when the endpoint is an address of this host and its port is
        free here (on every interface, as torchrun's store: a hostname may resolve to
        loopback on its own host); otherwise reach the one that serves it (retrying until
        the join timeout)."""
        lib = core.require(core.rendezvous(), "the rendezvous of one ddlrun per node")
        host, port = self.rz.host, self.rz.port
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, port,
                                                           type=socket.SOCK_STREAM)[0]
        except OSError as exc:
            raise OSError(f"--rdzv-endpoint {host}: {exc.strerror or exc}") from None
        addr = sockaddr[0]
        if _is_here(family, addr):
            try:
                self.server = lib.StoreServer("::" if family == socket.AF_INET6 else "0.0.0.0",
                                              port, self.secret, timeout=self.rz.join_timeout)
                self.serving = True
            except (OSError, self.errors.DDLConfigError):  # another ddlrun here serves it
                self.server = None
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

    def master(self, rnd: rdzv.Round) -> tuple[str, int] | None:
        """Where round ``rnd``'s ranks meet: node 0 picks a free port on its address the
        other nodes reach and publishes it; the others read it (None when node 0 did not
        say within ``MASTER_WAIT``: it was lost)."""
        key = f"master/{rnd.number}"
        if rnd.node_rank == 0:
            addr = _my_address(self.cfg.request.network_interface, self.rz.host, self.rz.port)
            port = pick_free_pair()
            self.store.set(key, f"{addr} {port}".encode())
            return addr, port
        try:
            addr, port = self.store.get(key, MASTER_WAIT).decode().split()
        except self.errors.DDLTimeoutError:
            return None
        return addr, int(port)

    def publish_cause(self, rnd: rdzv.Round, ev: RankExit) -> None:
        """The first rank of the round that failed of its own accord, job-wide."""
        line = (f"rank {ev.rank} on node {rnd.node_rank} ({self.me}) "
                f"{describe_code(ev.code)}")
        self.store.compare_set(f"cause/{rnd.number}", b"",
                               json.dumps({"code": exit_code(ev.code), "line": line}).encode())

    def cause(self, rnd: rdzv.Round) -> dict[str, Any] | None:
        key = f"cause/{rnd.number}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    # ----------------------------------------------------------------- a round
    def run_round(self, rnd: rdzv.Round, run_id: str, deadline: float | None
                  ) -> Outcome | None:
        """Run this node's ranks for round ``rnd``; None when node 0 never said where."""
        where = self.master(rnd)
        if where is None:
            return None
        addr, port = where
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
        events = _Events(self, rnd)
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
        beats: dict[str, tuple[int, float]] = {}
        while not stop.wait(WATCH):
            try:
                # this node beats while its ranks run, so that a node lost with its ddlrun
                # (its host) is told from a slow one when a round fails (see follow)
                rdzv.beat(self.store, self.me)
                why = rdzv.watch(self.store, rnd, self.rz.max_nodes, beats)
            except Exception as exc:  # noqa: BLE001 - the store is gone; the ranks go on
                self.sink.note(f"rendezvous: lost the store at {self.rz.host}:"
                               f"{self.rz.port} ({exc}); this node's ranks go on, but no "
                               "restart or new node is possible")
                return
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
            if outcome is None:  # node 0 lost before it said where the ranks meet
                line = f"node 0 ({rnd.nodes[0]}) did not start round {rnd.number}"
                code = self.after_failure(rnd, 1, f"{line} (lost?)", deadline)
            elif outcome.late_signal is not None:
                return self.stopped(rnd, 128 + outcome.late_signal)
            elif isinstance(outcome.failure, Superseded):
                continue
            elif outcome.code == 0:
                return self.finished(rnd)
            elif not isinstance(outcome.failure, RankExit):  # a signal, --timeout, 127
                return self.stopped(rnd, outcome.code)
            else:
                code = self.after_rank_failure(rnd, outcome.failure, outcome.code, deadline)
            if code is not None:
                return code

    def after_rank_failure(self, rnd: rdzv.Round, failure: RankExit, code: int,
                           deadline: float | None) -> int | None:
        """One of this node's ranks failed: restart every node, or end the job (its exit
        code), or follow the node whose rank caused it (None: go on to the next round)."""
        line = (f"rank {failure.rank} on node {rnd.node_rank} ({self.me}) "
                f"{describe_code(failure.code)}")
        if tier(failure.record, failure.code) != ROOT:
            unheard = self.follow(rnd)
            if unheard is None:
                return None  # the node that caused it moved the job on (follow says so)
            cause = self.cause(rnd)
            if cause is not None:
                code, line = int(cause["code"]), str(cause["line"])
            else:
                line = f"{line} because of a peer, and {unheard}"
        return self.after_failure(rnd, code, line, deadline)

    def after_failure(self, rnd: rdzv.Round, code: int, line: str,
                      deadline: float | None) -> int | None:
        """Restart every node through the next round, or end the job (exit code)."""
        cfg = self.cfg
        st = rdzv.read(self.store) or {}
        if st.get("phase") == "closed":
            raise rdzv.RendezvousClosed(st.get("end") or {})
        if st.get("round") != rnd.number:  # another node acted first: follow it
            self._moved_on(st)
            return None
        why = None
        if self.someone_done(rnd):
            why = f"{line} after a node had finished: no restart"
        elif int(st.get("failures", 0)) >= cfg.max_restarts:
            why = f"{line}; no restart left (--max-restarts {cfg.max_restarts})"
        elif deadline is not None and time.monotonic() >= deadline:
            why = f"{line}; --timeout used up: no restart"
        if why is not None:
            return self.end(code, why, rnd.number)  # None: moved on meanwhile
        st = rdzv.next_round(self.store, rnd.number, failed=True, why=line)
        if st.get("phase") == "closed":
            raise rdzv.RendezvousClosed(st.get("end") or {})
        if st.get("why") == line:
            self.sink.note(f"{line}; restart {st.get('failures')} of "
                           f"{cfg.max_restarts}: every node starts again")
        else:
            self._moved_on(st)
        return None

    def stopped(self, rnd: rdzv.Round, code: int) -> int:
        """This node stops (a signal to ddlrun, its --timeout, a program that cannot start)
        but the job does not: the rendezvous stays open, as torchrun's, and while restarts
        are left this node opens the next round for the others at once (they would wait for
        a cause otherwise); it counts as a failure, as the others' failing ranks would. With
        no restart left it ends the job with its own reason, which the others then give
        (they would take it for a lost host otherwise)."""
        why = f"node {rnd.node_rank} ({self.me}) stopped ({describe_code(code)})"
        try:
            st = rdzv.read(self.store) or {}
            if st.get("round") == rnd.number and st.get("phase") == "formed":
                if int(st.get("failures", 0)) < self.cfg.max_restarts:
                    rdzv.next_round(self.store, rnd.number, failed=True, why=why)
                else:
                    rdzv.close(self.store, exit_code(code),
                               f"{why}; no restart left (--max-restarts "
                               f"{self.cfg.max_restarts})", rnd.number)
        except Exception:  # noqa: BLE001, S110 - the store is gone: the others find out
            pass
        return code

    def follow(self, rnd: rdzv.Round) -> str | None:
        """This node's ranks failed because of a peer: wait for the node whose rank caused
        it to move the job on (None) or close it (``RendezvousClosed``); otherwise why this
        node stops waiting. A node that published a cause is given its teardown
        (``--grace``) and ``FOLLOW`` seconds more. Without a cause, a member whose heartbeat
        stopped for ``STALE`` seconds is lost with its ddlrun (its host), and nobody else
        will act; a member that still beats gets ``FOLLOW`` seconds."""
        start = time.monotonic()
        others = [n for n in rnd.nodes if n != self.me]
        beats: dict[str, tuple[int, float]] = {}
        beaten = -rdzv.STALE
        while True:
            beaten = rdzv.beat_if_due(self.store, self.me, beaten)
            st = rdzv.read(self.store) or {}
            if st.get("phase") == "closed":
                raise rdzv.RendezvousClosed(st.get("end") or {})
            if st.get("round") != rnd.number:
                self._moved_on(st)
                return None
            limit = FOLLOW
            if self.store.check([f"cause/{rnd.number}"]):
                limit += self.cfg.options.grace + FOLLOW
            else:
                lost = rdzv.stale(self.store, others, beats, time.monotonic)
                if lost:
                    return (f"node(s) {', '.join(lost)} of round {rnd.number} stopped beating "
                            f"for {rdzv.STALE:g} s without reporting a cause (lost with "
                            "their host?)")
            if time.monotonic() - start >= limit:
                return (f"no node reported a cause within {FOLLOW:g} s (a node lost with "
                        "its ddlrun?)")
            time.sleep(0.1)

    def _moved_on(self, st: dict[str, Any]) -> None:
        self.sink.note(f"this node's ranks failed because of a peer; round {st.get('round')} "
                       "began" + (f": {st['why']}" if st.get("why") else ""))

    def someone_done(self, rnd: rdzv.Round) -> bool:
        return self.store.check([f"done/{rnd.number}"]) and \
            self.store.add(f"done/{rnd.number}", 0) > 0

    def finished(self, rnd: rdzv.Round) -> int:
        """This node's ranks all ended well: wait at the exit barrier for the other nodes
        (up to ``EXIT_BARRIER``, as torchrun's agents do), then exit 0 whatever it saw."""
        try:
            done = self.store.add(f"done/{rnd.number}", 1)
            end = time.monotonic() + EXIT_BARRIER
            beaten = time.monotonic()
            while done < rnd.nnodes and time.monotonic() < end:
                beaten = rdzv.beat_if_due(self.store, self.me, beaten)  # done, not lost
                st = rdzv.read(self.store) or {}
                if st.get("phase") == "closed" or st.get("round") != rnd.number:
                    break
                time.sleep(0.1)
                done = self.store.add(f"done/{rnd.number}", 0)
            if done >= rnd.nnodes:
                rdzv.close(self.store, 0, "every node finished")
            else:
                self.sink.note(f"warning: {rnd.nnodes - done} node(s) had not finished after "
                               f"{EXIT_BARRIER:g} s (the exit barrier); this node is done")
        except Exception as exc:  # noqa: BLE001 - the store's node has gone: ours is done
            self.sink.note(f"warning: rendezvous lost at the exit barrier ({exc}); this "
                           "node's ranks finished")
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
        """Leave the rendezvous and close the store. The node serving it stays until every
        node of the job has left (``EXIT_BARRIER`` at most): they need it to learn how the
        job ended, or to go on."""
        try:
            if self.store is not None:
                rdzv.leave(self.store, self.me)
                self.store.add("left", 1)
                if self.serving:
                    end = time.monotonic() + EXIT_BARRIER
                    while time.monotonic() < end and self._others_here():
                        time.sleep(0.2)
                self.store.close()
        except Exception:  # noqa: BLE001, S110 - the store's ddlrun is gone: nothing to close
            pass
        finally:
            if self.server is not None:
                self.server.close()

    def _others_here(self) -> bool:
        """Whether a node of the job has not left yet (a member or a waiting node whose
        heartbeat still moves, or that is in the last round)."""
        st = rdzv.read(self.store) or {}
        members = set(st.get("nodes", ())) | set(st.get("waiting", ()))
        return self.store.add("left", 0) < len(members)


def _is_here(family: int, addr: str) -> bool:
    """Whether ``addr`` is one of this host's addresses (loopback included)."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((addr, 0))
        return True
    except OSError:
        return False


def _my_address(iface: str | None, host: str, port: int) -> str:
    """This host's address for the other nodes' ranks: --network-interface's, else the
    one on the route to the endpoint, else (that being loopback: the endpoint is this
    host's own name) the one on the default route; loopback only when nothing else is."""
    if iface:
        found = interface_address(iface)
        if found:
            return found
    addr = _route_to(host, port)
    if ipaddress.ip_address(addr).is_loopback:
        try:
            addr = _route_to("192.0.2.1", 9)  # TEST-NET: no packet is sent
        except OSError:
            pass
    return addr


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
    except node.errors.DDLError as exc:  # the store's: its ddlrun (and host) are gone
        sink.note(f"rendezvous: lost the store at {cfg.rendezvous.host}:"
                  f"{cfg.rendezvous.port}: {exc}")
        return 1
    finally:
        sink.close()

