"""ddlrun's elastic driver (Horovod's ``horovodrun --min-np/--max-np
--host-discovery-script``): the workers stay alive while the world changes around them.

The driver keeps a store (ddl's own rendezvous store, guarded by the job's secret; the
keys are ``ddl.elastic.link``'s) and a table of workers, each named ``host:slot`` for
good. It forms world 0 from the hosts (given, or printed by the discovery script) and
starts its workers. Then, in one loop:

- a worker that fails (non-zero exit, a signal) is out, its slot blacklisted (for good,
  or for a cooldown with ``--blacklist-cooldown-range``); the driver forms the next world
  from the workers left and the slots free (``elastic_plan.plan_world``: rank 0 and the
  ranks' order kept where they can be), writes every worker's place in it, starts the
  workers of new slots, and the survivors, whose collective failed, restore their last
  commit and take their places (``ddl.elastic.run``);
- the discovery script runs again every ``--discovery-interval`` seconds: when hosts come
  or go, the next world is formed and announced (``update``), and the workers move to it
  at their next ``commit()`` / ``check_host_updates()``;
- fewer than ``--min-np`` workers left, or more worlds than ``--reset-limit``: the job
  ends, non-zero, naming what was lost.

Each world is a job of its own for ddl (``<job id>.e<N>``: new shared memory, a new
rendezvous port), planned by the same ``make_plan`` as any job, so every variable of the
env contract, the grid and ``DDL_OPTIONS`` fit the world's size. Every event is one
``ddlrun:`` line. Workers on ddlrun's own host are its children, a remote host's run
under an agent over ssh (``elastic_workers``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shlex
import shutil
import signal
import time
from collections.abc import Mapping
from typing import Any

from . import core, envs
from .config import Config, Elastic
from .diagnose import flight_folder, private, tidy
from .elastic_hosts import Blacklist, DiscoveryError, check_script, run_discovery
from .elastic_plan import Worker, World, describe_world, plan_world
from .elastic_workers import HostGone, WorkerExit, Workers, source_address
from .errors import UsageError
from .events import describe_code
from .failures import RecordFolder
from .hosts import HostSpec
from .output import OutputSink
from .plan import HostFacts, make_plan
from .preflight import pick_free_pair
from .run import Interrupted, exit_code, signals_deferred, signals_raise
from .shm import cleanup, job_secret
from .steps import JobInputs, sweep_at_start

POLL = 0.2  # seconds between looks at the store (restored commits) and the clock


def world_job_id(run_id: str, generation: int) -> str:
    """World ``generation``'s job id: its own shared memory and flight-recorder folder."""
    return run_id if generation == 0 else f"{run_id}.e{generation}"


def first_hosts(cfg: Config) -> dict[str, int]:
    """The hosts of world 0 without a discovery script: ``-H``/``--hostfile`` (this host,
    with ``-np`` slots, when none is given), with their slots (``--max-np`` when a host
    does not say)."""
    el = cfg.elastic
    assert el is not None
    out: dict[str, int] = {}
    for h in cfg.request.hosts or (HostSpec("localhost"),):
        out[h.name] = out.get(h.name, 0) + (h.slots or el.slots or el.max_np)
    return out


class _Driver:
    def __init__(self, cfg: Config, facts: Mapping[str, HostFacts], inputs: JobInputs,
                 sink: OutputSink, environ: Mapping[str, str]) -> None:
        assert cfg.elastic is not None
        self.cfg, self.el, self.facts, self.inputs = cfg, cfg.elastic, facts, inputs
        self.sink, self.environ = sink, environ
        self.run_id = inputs.job_id
        self.secret = job_secret(dict(inputs.secret_env))
        if self.secret is None:  # the store hands out launch variables: never to strangers
            raise UsageError("an elastic job needs the job's secret for ddlrun's store, and "
                             "none can be read here (DDL_JOB_SECRET_FILE unreadable?)")
        self.records = RecordFolder(self.run_id)
        self.workers = Workers(sink, cfg.options, self.records, cfg.options.cwd)
        self.server: Any = None
        self.store: Any = None
        self.store_addr = ""
        self.blacklist = Blacklist(self.el.cooldown)
        self.order: list[str] = []  # hosts in the order first seen
        self.keys: dict[Worker, int] = {}  # a worker's process key (its output tag)
        self.running: set[Worker] = set()
        self.done: set[Worker] = set()
        self.leaving: set[Worker] = set()
        self.lost: list[str] = []  # what the job lost, for the last line
        self.gone_hosts: list[str] = []  # hosts whose agent was lost: swept at the end
        self.started_in: dict[Worker, int] = {}  # the world each worker was started into
        self.formed = 0  # the newest world every worker has joined (its rank 0 said so)
        self.finish_by: float | None = None  # a worker succeeded: the others' time to end
        self.stall_since: float | None = None  # workers left the world on their own since
        self.dropped: set[int] = set()  # keys of workers stopped before they joined
        self.next_key = 0
        self.by_key: dict[int, Worker] = {}
        self.world: World | None = None
        self.generation = -1
        self.restored = b""
        self.hosts: dict[str, int] = {}
        self.argv: tuple[str, ...] = ()

    # ------------------------------------------------------------------ hosts
    def discover(self) -> dict[str, int]:
        el = self.el
        if el.discovery_script is None:
            hosts = first_hosts(self.cfg)
        else:
            hosts = run_discovery(el.discovery_script, el.discovery_timeout, el.slots,
                                  cwd=self.cfg.options.cwd)
        for h in hosts:
            if h not in self.order:
                self.order.append(h)
        return hosts

    def available(self) -> dict[str, int]:
        """The hosts with their slots that are not blacklisted."""
        return self.blacklist.filter(dict(self.hosts))

    def plan(self) -> tuple[World, list[Worker]] | None:
        """The next world from the workers alive and the slots free; a slot whose worker
        failed stays empty while it is blacklisted."""
        alive = sorted(self.running - self.leaving, key=lambda w: (w.host, w.slot))
        excluded = frozenset(name for name in self.blacklist.blacklisted() if ":" in name
                             and name.rpartition(":")[0] in self.hosts)
        # a leaving worker's slot is its own until it has exited: no second process there
        excluded |= {w.name for w in self.leaving}
        return plan_world(self.available(), alive, self.el.min_np, self.el.max_np,
                          self.order, previous=self.world, excluded=excluded)

    # ------------------------------------------------------------------ worlds
    def form(self, why: str, announce: bool) -> str | None:
        """Form and publish the next world; why it cannot be, or None."""
        self.replace_unjoined()
        alive = sorted(self.running - self.leaving, key=lambda w: (w.host, w.slot))
        planned = self.plan()
        if planned is None:
            return (f"{len(alive)} worker(s) left, fewer than --min-np {self.el.min_np}: "
                    f"ending; lost: {', '.join(self.lost) or 'none'}")
        world, new = planned
        if self.world is not None and not any(p.worker in alive for p in world.places):
            # its rank 0 would be a new worker: the committed state would be lost
            return ("the next world would have no worker of the last one (the hosts that "
                    "had them are gone): the state would be lost; ending")
        self.generation += 1
        g = self.generation
        envs_of = self.world_env(world, g)
        in_world = {p.worker for p in world.places}
        for w in alive:
            if w not in in_world:
                self.store.set(f"world/{g}/{w.name}",
                               json.dumps({"leave": "no place in the new world"}).encode())
                self.leaving.add(w)
        for p in world.places:
            place = {"env": envs_of[p.worker], "sync": bool(new)}
            self.store.set(f"world/{g}/{p.worker.name}", json.dumps(place).encode())
        self.store.set("gen", str(g).encode())
        if g > 0:
            self.store.set(f"next/{g - 1}", str(g).encode())
        if announce:
            removed_only = not new
            self.store.set("update", f"{g} {int(removed_only)}".encode())
        self.world = world
        self.stall_since = None
        grid = envs_of[world.places[0].worker].get(envs.DDL_OPTIONS, "")
        self.sink.note(f"world {g} ({why}): {describe_world(world)}"
                       + (f", DDL_OPTIONS {grid!r}" if grid else ""))
        self.workers.new_world(world_job_id(self.run_id, g))
        self.start(new, envs_of, world_job_id(self.run_id, g))
        return None

    def replace_unjoined(self) -> None:
        """Workers started into a world that never formed (it is being superseded before
        every worker joined it) wait in ``init()`` for a rendezvous nobody else comes to:
        they hold no state yet, so they are stopped, and their slots are free for new
        workers of the next world."""
        self.read_formed()  # fresh: a world may have formed since the last poll
        if self.generation <= self.formed:
            return
        stale = [w for w in self.running - self.leaving
                 if self.started_in.get(w) == self.generation]
        if not stale:
            return
        keys = [self.keys.pop(w) for w in stale]  # a new worker there gets a new key
        for w in stale:
            self.running.discard(w)
        self.dropped.update(keys)
        self.workers.stop(keys)
        self.sink.note(f"world {self.generation} did not form: restarting its new workers "
                       f"{', '.join(w.name for w in stale)} in the next")

    def world_env(self, world: World, g: int) -> dict[Worker, dict[str, str]]:
        """Every worker's launch variables in world ``g``: ``make_plan`` of a job with the
        world's hosts and sizes, plus the elastic ones."""
        counts: dict[str, int] = {}
        for p in world.places:
            counts[p.worker.host] = counts.get(p.worker.host, 0) + 1
        req = dataclasses.replace(
            self.cfg.request, nproc=world.size,
            hosts=tuple(HostSpec(h, slots=counts[h]) for h in world.hosts))
        job_id = world_job_id(self.run_id, g)
        port = self.cfg.master_port or pick_free_pair()
        plan = make_plan(req, self.facts, job_id, port, self.environ, self.inputs.secret_env)
        by_rank = {r.rank: r for r in plan.ranks}
        out = {}
        for p in world.places:
            env = dict(by_rank[p.rank].env_dict())
            env.update({
                envs.DDL_FLIGHT_DIR: flight_folder(job_id),
                envs.DDL_ELASTIC_STORE: self.store_addr,
                envs.DDL_ELASTIC_WORKER: p.worker.name,
                envs.DDL_ELASTIC_GENERATION: str(g),
                envs.DDL_ELASTIC_TIMEOUT: f"{self.el.timeout:g}",
            })
            out[p.worker] = env
        self.argv = by_rank[0].argv
        return out

    def new_key(self, w: Worker) -> int:
        """A key of its own for each process started (its output tag), even in a slot an
        earlier process had."""
        key = self.keys[w] = self.next_key
        self.by_key[key] = w
        self.next_key += 1
        return key

    def start(self, workers: list[Worker], envs_of: Mapping[Worker, Mapping[str, str]],
              job_id: str) -> None:
        by_host: dict[str, list] = {}
        for w in workers:
            env = dict(envs_of[w])
            if self.generation > 0 and envs.DDL_INIT_TIMEOUT not in self.environ:
                # a new worker waits in ddl.init() until the others reach its world
                env[envs.DDL_INIT_TIMEOUT] = f"{self.el.timeout:g}"
            by_host.setdefault(w.host, []).append((self.new_key(w), self.argv, env))
            self.running.add(w)
            self.started_in[w] = self.generation
        if workers and self.cfg.verbose:
            self.sink.note("running: " + shlex.join(self.argv))
        for host, specs in by_host.items():
            self.workers.start(host, specs, job_id)

    # ------------------------------------------------------------------ events
    def worker_of(self, key: int) -> Worker:
        return self.by_key[key]

    def place_of(self, w: Worker) -> str:
        world = self.world
        rank = next((p.rank for p in world.places if p.worker == w), None) if world else None
        return f"worker {w.name}" + (f" (rank {rank} of world {self.generation})"
                                     if rank is not None else "")

    def on_event(self, ev: WorkerExit | HostGone) -> int | None:
        """Handle one worker's exit or a lost host; the job's exit code when it ends."""
        if isinstance(ev, HostGone):
            return self.host_gone(ev)
        if ev.key in self.dropped:  # stopped before it joined a world: expected
            self.dropped.discard(ev.key)
            return None
        w = self.worker_of(ev.key)
        if self.keys.get(w) != ev.key:  # an earlier process of this slot
            return None
        self.running.discard(w)
        if ev.error is not None:
            self.sink.note(f"cannot start {self.argv[0]} on {w.host}: {ev.error}")
            if self.generation == 0:
                return 127  # the program cannot start at all
            ev = WorkerExit(ev.key, 127, None)
        if w in self.leaving:
            self.leaving.discard(w)
            how = "" if ev.code == 0 else f" ({describe_code(ev.code)})"
            self.sink.note(f"{self.place_of(w)} left{how}: no place in world {self.generation}")
            return None
        if ev.code == 0:
            self.done.add(w)
            if self.finish_by is None:  # Horovod's rule: a worker that succeeded ends the job
                self.finish_by = time.monotonic() + max(self.cfg.options.grace, 5.0)
            return 0 if not (self.running - self.leaving) else None
        how = describe_code(ev.code)
        if ev.record is not None:
            how = f"{ev.record.summary(self.cfg.options.cwd or os.getcwd())}, {how}"
        if self.done:
            if ev.record is None or ev.record.after_peer:
                return 0 if not (self.running - self.leaving) else None  # lost a finished peer
            self.sink.note(f"{self.place_of(w)} failed ({how}) after others finished: ending")
            return exit_code(ev.code)
        self.lost.append(f"{w.name} ({how})")
        self.blacklist.add(w.name)
        self.sink.note(f"{self.place_of(w)} failed ({how}); re-forming the world")
        return self.reform("a worker was lost", announce=False, code=exit_code(ev.code))

    def host_gone(self, ev: HostGone) -> int | None:
        gone = [self.worker_of(k) for k in ev.keys if k not in self.dropped]
        gone = [w for w in gone if w in self.running]
        for w in gone:
            self.running.discard(w)
            self.leaving.discard(w)
        if not gone:
            return None
        self.lost.append(f"host {ev.host} ({ev.why})")
        self.gone_hosts.append(ev.host)
        self.blacklist.add(ev.host)
        names = ", ".join(w.name for w in gone)
        if self.done:  # a worker finished: the job is ending anyway
            return 0 if not (self.running - self.leaving) else None
        self.sink.note(f"host {ev.host} lost ({ev.why}): workers {names}; re-forming the world")
        return self.reform(f"host {ev.host} was lost", announce=False, code=255)

    def reform(self, why: str, announce: bool, code: int = 1) -> int | None:
        limit = self.el.reset_limit
        if limit is not None and self.generation + 1 > limit:
            self.sink.note(f"the world was re-formed {self.generation} time(s) "
                           f"(--reset-limit {limit}): ending")
            return code or 1
        cannot = self.form(why, announce)
        if cannot:
            self.sink.note(cannot)
            return code or 1
        return None

    def rediscover(self) -> int | None:
        try:
            hosts = self.discover()
        except DiscoveryError as exc:  # a script that fails later: keep the hosts we have
            self.sink.note(f"warning: {exc}; keeping the hosts found before")
            return None
        changed = hosts != self.hosts
        added = [h for h in hosts if h not in self.hosts or hosts[h] > self.hosts[h]]
        removed = [h for h in self.hosts if h not in hosts or hosts[h] < self.hosts[h]]
        self.hosts = hosts
        for h in added:
            self.sink.note(f"host {h} has {hosts[h]} slot(s) now (discovery)")
        for h in removed:
            self.sink.note(f"host {h} has {hosts.get(h, 0)} slot(s) now (discovery)")
        current = {p.worker for p in self.world.places} if self.world else set()
        world = self.plan()
        if world is not None and {p.worker for p in world[0].places} == current:
            return None  # the same workers: nothing to re-form
        why = "hosts changed" if changed else "a slot is free again"
        return self.reform(why, announce=True)

    def check_stalled(self, now: float) -> int | None:
        """Workers that left the current world although ddlrun formed no other (a collective
        timed out: a worker is stuck, or a false alarm): once every worker of the world has
        left it, or the workers' ``DDL_TIMEOUT`` (and 5 s) has passed since the first did,
        those that did not are stuck: stopped and blacklisted; the next world is formed."""
        g, world = self.generation, self.world
        if world is None or self.finish_by is not None:
            return None
        counter = f"resets/{g}"
        if not self.store.check([counter]) or self.store.add(counter, 0) == 0:
            return None
        if self.stall_since is None:
            self.stall_since = now
        members = [p.worker for p in world.places if p.worker in self.running]
        left = {w for w in members if self.store.check([f"reset/{w.name}"])
                and self.store.get(f"reset/{w.name}") == str(g).encode()}
        if len(left) < len(members) and now - self.stall_since < self.stall_window():
            return None
        self.stall_since = None
        stuck = [w for w in members if w not in left]
        if not stuck:
            self.sink.note(f"every worker left world {g} without a loss (a collective timed "
                           "out); re-forming the world")
            return self.reform("the workers left it", announce=False)
        for w in stuck:
            self.running.discard(w)
            self.dropped.add(self.keys[w])
            self.blacklist.add(w.name)
            self.lost.append(f"{w.name} (stuck)")
        self.workers.stop([self.keys[w] for w in stuck])
        names = ", ".join(w.name for w in stuck)
        self.sink.note(f"worker(s) {names} of world {g} did not leave it with the others "
                       "(stuck?): stopped; re-forming the world")
        return self.reform("a worker was stuck", announce=False)

    def stall_window(self) -> float:
        """How long the others may still be waiting in a collective after the first left:
        the workers' DDL_TIMEOUT, and 5 s."""
        raw = self.environ.get(envs.DDL_TIMEOUT_VAR) or dict(self.cfg.request.env).get(
            envs.DDL_TIMEOUT_VAR) or "30"
        try:
            return float(raw) + 5.0
        except ValueError:
            return 35.0

    def read_formed(self) -> None:
        """The newest world whose rank 0 said every worker joined it."""
        if self.store.check(["formed"]):
            self.formed = max(self.formed, int(self.store.get("formed")))

    def check_restored(self) -> None:
        self.read_formed()
        if not self.store.check(["restored"]):
            return
        value = self.store.get("restored")
        if value != self.restored:
            self.restored = value
            commit, _, g = value.decode().partition(" ")
            self.sink.note(f"world {g} goes on from commit {commit} (restored)")

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        self.hosts = self.discover()
        self.open_store()
        if self.form("start", announce=False):
            raise UsageError(f"the hosts have {sum(self.available().values())} slot(s), fewer "
                             f"than --min-np {self.el.min_np}")
        deadline = time.monotonic() + self.cfg.timeout if self.cfg.timeout else None
        next_discovery = time.monotonic() + self.el.discovery_interval
        while True:
            try:
                ex = self.workers.events.get(timeout=POLL)
            except queue.Empty:
                ex = None
            if ex is not None:
                code = self.on_event(ex)
                if code is not None:
                    return code
            now = time.monotonic()
            # the hosts may change (discovery), or a blacklisted slot's cooldown end
            if (self.el.discovery_script or self.el.cooldown) and now >= next_discovery:
                next_discovery = now + self.el.discovery_interval
                code = self.rediscover()
                if code is not None:
                    return code
            self.check_restored()
            code = self.check_stalled(now)
            if code is not None:
                return code
            if self.finish_by is not None and now >= self.finish_by:
                left = sorted(w.name for w in self.running)
                self.sink.note(f"a worker finished; stopping those still running "
                               f"({', '.join(left)})")
                return 0
            if deadline is not None and now >= deadline:
                self.sink.note(f"--timeout {self.cfg.timeout:g}s: stopping the workers")
                return 124

    def open_store(self) -> None:
        """The store the workers meet ddlrun at: on this host's address the (remote) hosts
        reach, guarded by the job's secret."""
        rdzv = core.require(core.rendezvous(), "elastic training's store")
        addr = source_address(list(self.hosts), {h: f.address for h, f in self.facts.items()})
        self.server = rdzv.StoreServer(addr, 0, self.secret, timeout=self.el.timeout)
        host = f"[{addr}]" if ":" in addr else addr
        self.store_addr = f"{host}:{self.server.port}"
        self.store = rdzv.StoreClient(addr, self.server.port, self.secret, rank=-1,
                                      timeout=10.0)

    def close(self, succeeded: bool = False) -> None:
        """Stop every worker, close the store, remove each world's shared memory; the
        flight recorder's dumps of the worlds a lost peer ended stay only when the job
        failed (a job that went on has said what it lost, and a long one loses often)."""
        try:
            self.workers.close(self.cfg.options.grace)
            self.workers.sweep(self.gone_hosts, self.inputs.secret_env)
        finally:
            try:
                if self.store is not None:
                    self.store.close()
                if self.server is not None:
                    self.server.close()
            finally:
                for g in range(self.generation + 1):
                    job_id = world_job_id(self.run_id, g)
                    cleanup(job_id, None, self.secret, self.sink.note)
                    folder = flight_folder(job_id)
                    if succeeded and private(folder):
                        shutil.rmtree(folder, ignore_errors=True)
                    tidy(folder)
                self.records.remove()


def run_elastic(cfg: Config, facts: Mapping[str, HostFacts], inputs: JobInputs,
                sink: OutputSink, environ: Mapping[str, str]) -> int:
    """Run an elastic job to its end; its exit code."""
    el: Elastic | None = cfg.elastic
    assert el is not None
    if el.discovery_script:
        check_script(el.discovery_script)
    sweep_at_start(sink)
    driver = None
    try:
        with signals_raise():
            driver = _Driver(cfg, facts, inputs, sink, environ)
            code = None
            try:
                code = driver.run()
                return code
            finally:
                with signals_deferred():
                    driver.close(succeeded=code == 0)
    except DiscoveryError as exc:
        sink.note(f"error: {exc}")
        return 2
    except OSError as exc:  # the store's address or port
        sink.note(f"elastic: {exc}")
        return 2
    except Interrupted as exc:
        sink.note(f"{signal.Signals(exc.signum).name}: the workers were stopped")
        return 128 + exc.signum
    finally:
        sink.close()
