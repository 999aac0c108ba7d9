"""This process's place in the job: what ``ddl.init()`` makes (the world, the engine, the
queue of work, the device router, the groups), released together by ``ddl.shutdown()``,
and what reads it (``rank()``, ``malloc()``, ``new_group()``...).

``session()``, ``current()``, ``target()``, ``dispatch()`` and ``job_engine()`` are the
internal API that ``ddl.planning`` and the adapters (:mod:`ddl.hvd`) build on; the public
names are re-exported by :mod:`ddl.api` and ``ddl``.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import config, failures, flight, grid, identity, options, timeline
from .devices import DeviceRouter
from .engines.base import Engine
from .engines.gloo import GlooContext
from .engines.local import LocalEngine
from .engines.multihost import DimsEngine, MultiHostEngine, agree_gloo_beside
from .engines.shm import ShmEngine
from .errors import DDLConfigError, DDLError
from .groups import Group, GroupMaker, check_ranks
from .rendezvous import PortInUse, Rendezvous, connect
from .runtime import Runtime, callers_waiting
from .topology import World, world_from_env

_lock = threading.Lock()


@dataclasses.dataclass
class Session:
    """Everything ``init()`` made for this process's place in the job, released together
    by ``shutdown()``."""

    world: World
    engine: Engine  # the job's host engine
    runtime: Runtime  # the job's queue of work
    options: options.Options
    devices: DeviceRouter  # which torch tensors go to a device engine
    maker: GroupMaker
    # ddl's rendezvous: init's (job id, multi-host) or the device groups'
    rdzv: Rendezvous | None = None
    groups: list[Group] = dataclasses.field(default_factory=list)  # live new_group()s


_session: Session | None = None
# This process's ddl.init() calls so far. Every rank makes the same calls (as in Horovod),
# so the count names one generation of the job on every rank: the rendezvous of each init
# is told apart from the last one's, which may still hold the port (rendezvous/server.py).
_generation = 0


def session() -> Session | None:
    """This process's session, None before ``init()`` (internal API, like ``plan_*``)."""
    return _session


# ------------------------------------------------------------------------ lifecycle
def init() -> None:
    """Join the job described by the launch environment (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, ...; see docs/api.md). Without one, this process is a 1-rank world.
    Calling it again is a no-op."""
    global _session, _generation
    with _lock:
        if _session is not None:
            return
        _generation += 1
        failures.install()  # an uncaught exception writes this rank's failure record
        world = world_from_env()
        opts = options.parse(config.get("DDL_OPTIONS"))
        options.check_grid(opts, world.size)
        if opts.dbg_level or opts.dump_iter:
            _show_diagnostics()
        timeline.start_from_env(world.rank, config.get("DDL_TIMELINE"))
        world, rdzv = _identify(world)
        try:
            kind = _engine_kind(world, opts)
            # Under MPI every rank says whether it makes Gloo groups beside MPI's, and all do
            # or none. That first MPI call initialises MPI, which waits for every rank while
            # it holds the interpreter: before rank 0's rendezvous must greet them.
            beside = kind == "mpi" and agree_gloo_beside(
                grid.plan(world.rank, world.size, world.local_size, opts), rdzv)
            if rdzv is None and (kind == "gloo" or beside):
                rdzv = _join(world)
            engine = _make_engine(kind, world, opts, rdzv, beside)
        except BaseException:
            if rdzv is not None:
                rdzv.close()
            raise
        if opts.dbg_level and world.rank == 0:
            desc = engine.describe() if isinstance(engine, DimsEngine) else engine.name
            _log.info("[ddl] %d ranks on %d host(s), engine %s: %s; options %s", world.size,
                      world.num_hosts, engine.name, desc, opts.to_string() or "(none)")
        flight.start(world.rank, world.job_id)  # before the runtime, which writes to it
        runtime = Runtime()
        _session = Session(
            world=world, engine=engine, runtime=runtime, options=opts,
            devices=DeviceRouter(world, opts, _rendezvous),
            maker=GroupMaker(world, engine, runtime, timeout=config.get("DDL_TIMEOUT"),
                             chunk_bytes=config.get("DDL_CHUNK_BYTES"),
                             shm_kwargs=_shm_kwargs()),
            rdzv=rdzv)


_log = logging.getLogger("ddl")


class _StderrLines(logging.StreamHandler):
    """The message alone, on whatever ``sys.stderr`` is when the record comes."""

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)
        super().emit(record)


def _show_diagnostics() -> None:
    """``-dbg_level`` / ``-dump_iter`` asked for ddl's INFO lines (on rank 0): they go to the
    "ddl" logger, and unless the program gave that logger handlers of its own, one is added
    that prints each line to stderr as it always looked (handlers on the root logger get
    the records too, as they get ddl's warnings). The logger's level is raised to INFO only
    when the program left it unset."""
    if _log.level == logging.NOTSET:
        _log.setLevel(logging.INFO)
    if not _log.handlers:
        handler = _StderrLines()
        handler.setFormatter(logging.Formatter("%(message)s"))
        _log.addHandler(handler)


def _identify(world: World) -> tuple[World, Rendezvous | None]:
    """The world with its job id: given (ddlrun, DDL_JOB_ID, the process manager) or agreed
    now through ddl's rendezvous, which is then kept for the engines (see identity.py)."""
    if world.job_id:
        return world, None
    if world.size == 1:
        return dataclasses.replace(world, job_id=identity.random_job_id()), None
    addr, port = config.get("MASTER_ADDR"), _port()
    timeout = config.init_timeout()
    secret = identity.job_secret()
    try:
        rdzv = _join(world)
    except PortInUse as exc:
        # Another job's rank 0 holds the port: that job may have taken in this job's other
        # ranks, and must not complete with them (identity.agree_job_id).
        if secret is None and identity.report_second_owner(addr, port, _init_number(),
                                                           min(timeout, 2.0)):
            raise DDLConfigError(f"{exc}; the job that holds it was told, so neither job "
                                 "completes with the other's ranks") from None
        raise DDLConfigError(str(exc)) from None
    try:
        job_id = identity.agree_job_id(
            rdzv.client, world.rank, world.size, timeout, f"{addr}:{port}",
            settle=0.0 if secret is not None else config.get("DDL_RENDEZVOUS_SETTLE"))
    except BaseException:
        rdzv.close()
        raise
    return dataclasses.replace(world, job_id=job_id), rdzv


def _join(world: World) -> Rendezvous:
    """This init's generation of ddl's rendezvous, kept in the session so that shutdown()
    closes it (an engine's own one would outlive the session and keep the port)."""
    return connect(world.rank, world.size, config.get("MASTER_ADDR"), _port(),
                   identity.job_secret(), config.init_timeout(), generation=_init_number())


def _init_number() -> int:
    """Which ``init()`` of the job this is, as every rank counts it (the rendezvous refuses
    a rank at another one). In an elastic job each world is a new rendezvous that workers
    reach after different numbers of inits (a new worker after none): the world's number
    then (``DDL_ELASTIC_GENERATION``, which ddlrun sets for each world)."""
    if config.get("DDL_ELASTIC_STORE"):
        return config.get("DDL_ELASTIC_GENERATION") + 1
    return _generation


def _engine_kind(world: World, opts: options.Options) -> str:
    """Which engine the job runs: "local" for one rank; "shm" when every rank is on this
    host (any grid inside one host is the same set of ranks); otherwise the
    multi-dimensional engine over shared memory inside hosts and "gloo" or "mpi" across."""
    if world.size == 1:
        return "local"
    g = grid.plan(world.rank, world.size, world.local_size, opts)
    if world.local_size == world.size and all(d.intra_host for d in g.dims):
        return "shm"
    transport = config.get("DDL_TRANSPORT")
    if transport == "auto":
        transport = "mpi" if world.launched_by_mpi and _have("mpi4py") else "gloo"
    return transport


def _rendezvous() -> Any:
    """ddl's TCP store (a ``torch.distributed.Store``): the multi-host engine's when it has
    one (over Gloo), else one made now (all ranks get here at the same point: the first
    collective on a device tensor)."""
    s = current()
    if isinstance(s.engine, MultiHostEngine) and isinstance(s.engine.ctx, GlooContext):
        return s.engine.ctx.store
    # init's rendezvous when it opened one (to agree the job id, or for the multi-host
    # engine); else this init's generation of it, opened now and kept in the session so
    # that shutdown() closes it after the device groups (the next init listens again).
    if s.rdzv is None:
        s.rdzv = _join(s.world)
    return GlooContext(s.world.rank, s.world.size, config.get("MASTER_ADDR"), _port(),
                       config.get("DDL_TIMEOUT"), secret=identity.job_secret(),
                       rendezvous=s.rdzv).store


def _shm_kwargs() -> dict[str, Any]:
    return dict(
        init_timeout=config.init_timeout(),
        slot_bytes=config.get("DDL_SHM_SLOT_BYTES"),
        max_bytes=config.get("DDL_SHM_MAX_BYTES"),
        small_bytes=config.get("DDL_SHM_SMALL_BYTES"),
        wait_policy=config.get("DDL_SHM_WAIT"),
        heap_bytes=config.get("DDL_SHM_HEAP_BYTES"),
        fences=config.get("DDL_SHM_FENCES"),
        cma=config.get("DDL_SHM_CMA"),
        callers_waiting=callers_waiting,  # the runtime's count, read by the engine's waits
    )


def _make_engine(kind: str, world: World, opts: options.Options,
                 rdzv: Rendezvous | None = None, beside: bool = False) -> Engine:
    """The engine of ``_engine_kind``; ``rdzv``: init's rendezvous, which the multi-host
    engine makes its groups through (it stays the session's to close); ``beside``: the
    ranks agreed to make Gloo groups beside MPI's."""
    if kind == "local":
        return LocalEngine()
    if kind == "shm":
        return ShmEngine(job_id=world.job_id, host_index=world.host_index,
                         local_rank=world.local_rank, local_size=world.local_size,
                         global_rank=world.rank, timeout=config.get("DDL_TIMEOUT"),
                         dump_iter=opts.dump_iter, **_shm_kwargs())
    return MultiHostEngine(world, opts, transport=kind, addr=config.get("MASTER_ADDR"),
                           port=_port(),
                           timeout=config.get("DDL_TIMEOUT"),
                           chunk_bytes=config.get("DDL_CHUNK_BYTES"),
                           shm_kwargs=_shm_kwargs(), secret=identity.job_secret(),
                           rendezvous=rdzv, beside=beside)


def _port() -> int:
    return config.store_port(config.get("MASTER_PORT"), config.get("DDL_PORT"))


def _have(module: str) -> bool:
    """Importable, not merely present: a broken install (e.g. mpi4py built against an MPI
    that is gone) must fall back too."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def shutdown() -> None:
    """Finish queued work and release shared memory. Safe to call more than once."""
    global _session
    with _lock:
        s = _session
        if s is None:
            return
        try:
            s.runtime.close()
        finally:
            try:
                s.devices.close()
            finally:
                try:
                    while s.groups:
                        s.groups.pop().close()
                finally:
                    try:
                        s.engine.close()
                    finally:
                        if s.rdzv is not None:
                            s.rdzv.close()
                        _session = None
                        timeline.left_job()
                        flight.left_job()


def _at_exit() -> None:
    """The interpreter exits: the peers are told that this process leaves (and with which
    exception), not that it called ``ddl.shutdown()`` (ddl.failures)."""
    failures.at_exit()
    shutdown()


atexit.register(_at_exit)


def is_initialized() -> bool:
    return _session is not None


def current() -> Session:
    s = _session
    if s is None:
        raise DDLError("ddl is not initialized: call ddl.init() first")
    return s


def _w() -> World:
    return current().world


def rank() -> int:
    """This process's rank in the job, ``0 .. size() - 1``."""
    return _w().rank


def size() -> int:
    """The number of ranks in the job."""
    return _w().size


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    return _w().local_rank


def local_size() -> int:
    """The number of ranks on this host."""
    return _w().local_size


def cross_rank() -> int:
    """This host's index among the job's hosts (Horovod's cross rank)."""
    return _w().cross_rank


def cross_size() -> int:
    """The number of hosts in the job."""
    return _w().cross_size


def get_options() -> options.Options:
    """The job's parsed ``DDL_OPTIONS`` (mode, dump_iter, debug level)."""
    return current().options


def engine_name() -> str:
    return current().engine.name


def malloc(shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """A numpy array in this host's shared memory (IBM pyddl.malloc). Collectives on such
    arrays skip the staging copies; wrap with ``torch.from_numpy`` for a torch tensor."""
    heap = current().engine.heap
    if heap is None:
        return np.empty(shape, dtype=dtype)
    return heap.malloc(shape, dtype)


def shared_block(nbytes: int) -> np.ndarray | None:
    """``nbytes`` (uint8) of this rank's shared heap, for a long-lived buffer moved there
    (DDP's buckets): where no segment has room, the new one is sized to it, so /dev/shm
    holds no more than the buffers. None where the job's engine has no heap;
    ``DDLShmError`` when /dev/shm cannot take it."""
    heap = current().engine.heap
    if heap is None:
        return None
    return heap.malloc((nbytes,), np.uint8, exact=True)


def jobs_in_flight() -> int:
    """Jobs queued or running on ddl's workers, the job's and every group's: 0 when no
    collective anywhere can still read or write a tensor."""
    s = current()
    with _lock:
        runtimes = {id(r): r for r in [s.runtime, *(g.runtime for g in s.groups)]}
    return sum(r.busy_when_settled() for r in runtimes.values())  # groups may share one


def in_shared_memory(arr: np.ndarray) -> bool | None:
    """Whether ``arr`` (C-contiguous) lives in this rank's shared heap, where peers read and
    write it in place; None where the job's engine has no heap (``ddl.malloc`` gives private
    memory there: several hosts, MPI, gloo)."""
    heap = current().engine.heap
    if heap is None:
        return None
    return heap.locate(arr) != 0


# ------------------------------------------------------------------------ groups
def new_group(ranks: Sequence[int], *, timeout: float | None = None) -> Group | None:
    """A group of the given global ranks (in that order: ``ranks[i]`` is the group's rank
    ``i``) for the ``group=`` argument of the collectives. Its members must call this, in
    the same order as their other group creations, and it returns when all have (waiting
    up to ``timeout`` seconds, default ``DDL_INIT_TIMEOUT``); other ranks may call it too
    and get None."""
    s = current()
    ranks = check_ranks(ranks, s.world.size)
    if s.world.rank not in ranks:
        return None
    g = s.maker.make(ranks, config.init_timeout() if timeout is None else timeout)
    with _lock:
        s.groups.append(g)
    return g


def destroy_group(group: Group) -> None:
    """Finish ``group``'s queued collectives and release it (its shared memory, its
    network group). Using it afterwards raises. ``ddl.shutdown()`` releases every group."""
    target(group)
    s = current()
    with _lock:
        if group in s.groups:
            s.groups.remove(group)
    group.close()


def target(group: Group | None) -> tuple[Engine, int, int]:
    """(engine, rank, size) of the job, or of ``group``."""
    s = _session or current()  # current() raises when not initialized
    if group is None:
        return s.engine, s.world.rank, s.world.size
    if not isinstance(group, Group):
        raise DDLConfigError(f"group must be a ddl.Group from ddl.new_group, got {group!r}")
    if group.closed:
        raise DDLError(f"{group!r} was released (ddl.destroy_group or ddl.shutdown)")
    return group.engine, group.rank, group.size


def job_engine() -> Engine | None:
    """The job's engine (None before ``init()``): for control steps that need none of the
    planning (one small host array of one dtype)."""
    s = _session
    return None if s is None else s.engine


def dispatch(job: Callable[[], Any], name: str, *, async_: bool,
             group: Group | None = None, what: Any = None) -> Any:
    """Queue ``job`` behind the earlier work of the job (or of ``group``: each group has
    its own queue, as each torch process group has its own stream of work); ``what``
    describes its tensor in the flight recorder (``ddl.flight.what_text``)."""
    runtime = (_session or current()).runtime if group is None else group.runtime
    if async_:
        return runtime.submit(job, name, what)
    return runtime.run(job, name, what)
