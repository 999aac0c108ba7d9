"""The public, Horovod-shaped API of the ddl core (numpy arrays and torch tensors).

Each collective has one implementation (``plan_*``, which checks the arguments and returns
the work as a closure); the blocking, in-place and ``_async`` spellings below are thin
wrappers around it. ``plan_*``, :func:`dispatch` and :func:`job_engine` are the internal API
the framework adapters build on (:mod:`ddl.hvd`, ``ddl.torch``, ``ddl.tensorflow``); they are
not part of ``ddl.*``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import operator
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import config, failures, grid, identity, options, tensors, timeline
from .devices import DeviceRouter
from .engines.local import LocalEngine
from .errors import DDLConfigError, DDLError, DDLMismatchError
from .groups import Group, GroupMaker, check_ranks
from .ops import Average, ReduceOp, check_op, parse_op
from .rendezvous import PortInUse, connect
from .runtime import Handle, Runtime
from .topology import World, world_from_env

_lock = threading.Lock()


@dataclasses.dataclass
class Session:
    """Everything ``init()`` made for this process's place in the job, released together
    by ``shutdown()``."""

    world: World
    engine: Any  # the job's engine (engines/*.py)
    runtime: Runtime  # the job's queue of work
    options: options.Options
    devices: DeviceRouter  # which torch tensors go to a device engine
    maker: GroupMaker
    rdzv: Any = None  # ddl's rendezvous: init's (job id, multi-host) or the device groups'
    groups: list[Group] = dataclasses.field(default_factory=list)  # live new_group()s


_session: Session | None = None
# This process's ddl.init() calls so far. Every rank makes the same calls (as in Horovod),
# so the count names one generation of the job on every rank: the rendezvous of each init
# is told apart from the last one's, which may still hold the port (rendezvous.py).
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
            if rdzv is None and kind == "gloo":
                rdzv = _join(world)
            engine = _make_engine(kind, world, opts, rdzv)
        except BaseException:
            if rdzv is not None:
                rdzv.close()
            raise
        if opts.dbg_level and world.rank == 0:
            desc = engine.describe() if hasattr(engine, "describe") else engine.name
            _log.info("[ddl] %d ranks on %d host(s), engine %s: %s; options %s", world.size,
                      world.num_hosts, engine.name, desc, opts.to_string() or "(none)")
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


def _identify(world: World) -> tuple[World, Any]:
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
        if secret is None and identity.report_second_owner(addr, port, _generation,
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


def _join(world: World):
    """This init's generation of ddl's rendezvous, kept in the session so that shutdown()
    closes it (an engine's own one would outlive the session and keep the port)."""
    return connect(world.rank, world.size, config.get("MASTER_ADDR"), _port(),
                   identity.job_secret(), config.init_timeout(), generation=_generation)


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


def _rendezvous():
    """ddl's TCP store: the multi-host engine's when it has one, else one made now (all
    ranks get here at the same point: the first collective on a device tensor)."""
    s = _s()
    ctx = getattr(s.engine, "ctx", None)
    store = getattr(ctx, "store", None)
    if store is not None:
        return store
    from .engines.gloo import GlooContext

    # init's rendezvous when it opened one (to agree the job id, or for the multi-host
    # engine); else this init's generation of it, opened now and kept in the session so
    # that shutdown() closes it after the device groups (the next init listens again).
    if s.rdzv is None:
        s.rdzv = _join(s.world)
    return GlooContext(s.world.rank, s.world.size, config.get("MASTER_ADDR"), _port(),
                       config.get("DDL_TIMEOUT"), secret=identity.job_secret(),
                       rendezvous=s.rdzv).store


def _shm_kwargs() -> dict:
    return dict(
        init_timeout=config.init_timeout(),
        slot_bytes=config.get("DDL_SHM_SLOT_BYTES"),
        max_bytes=config.get("DDL_SHM_MAX_BYTES"),
        small_bytes=config.get("DDL_SHM_SMALL_BYTES"),
        wait_policy=config.get("DDL_SHM_WAIT"),
        heap_bytes=config.get("DDL_SHM_HEAP_BYTES"),
        fences=config.get("DDL_SHM_FENCES"),
        cma=config.get("DDL_SHM_CMA"),
    )


def _make_engine(kind: str, world: World, opts: options.Options, rdzv: Any = None):
    """The engine of ``_engine_kind``; ``rdzv``: init's rendezvous, which the multi-host
    engine makes its groups through (it stays the session's to close)."""
    if kind == "local":
        return LocalEngine()
    if kind == "shm":
        from .engines.shm import ShmEngine

        return ShmEngine(job_id=world.job_id, host_index=world.host_index,
                         local_rank=world.local_rank, local_size=world.local_size,
                         global_rank=world.rank, timeout=config.get("DDL_TIMEOUT"),
                         dump_iter=opts.dump_iter, **_shm_kwargs())
    from .engines.multihost import MultiHostEngine

    return MultiHostEngine(world, opts, transport=kind, addr=config.get("MASTER_ADDR"),
                           port=_port(),
                           timeout=config.get("DDL_TIMEOUT"),
                           chunk_bytes=config.get("DDL_CHUNK_BYTES"),
                           shm_kwargs=_shm_kwargs(), secret=identity.job_secret(),
                           rendezvous=rdzv)


def _port() -> int:
    return config.store_port(config.get("MASTER_PORT"), config.get("DDL_PORT"))


def _have(module: str) -> bool:
    """Importable, not merely present: a broken install (e.g. mpi4py built against an MPI
    that is gone) must fall back too."""
    import importlib

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


def _at_exit() -> None:
    """The interpreter exits: the peers are told that this process leaves (and with which
    exception), not that it called ``ddl.shutdown()`` (ddl.failures)."""
    failures.at_exit()
    shutdown()


atexit.register(_at_exit)


def is_initialized() -> bool:
    return _session is not None


def _s() -> Session:
    s = _session
    if s is None:
        raise DDLError("ddl is not initialized: call ddl.init() first")
    return s


def _w() -> World:
    return _s().world


def rank() -> int:
    return _w().rank


def size() -> int:
    return _w().size


def local_rank() -> int:
    return _w().local_rank


def local_size() -> int:
    return _w().local_size


def cross_rank() -> int:
    return _w().cross_rank


def cross_size() -> int:
    return _w().cross_size


def get_options() -> options.Options:
    return _s().options


def engine_name() -> str:
    return _s().engine.name


def malloc(shape, dtype=np.float32) -> np.ndarray:
    """A numpy array in this host's shared memory (IBM pyddl.malloc). Collectives on such
    arrays skip the staging copies; wrap with ``torch.from_numpy`` for a torch tensor."""
    heap = _s().engine.heap
    if heap is None:
        return np.empty(shape, dtype=dtype)
    return heap.malloc(shape, dtype)


def shared_block(nbytes: int) -> np.ndarray | None:
    """``nbytes`` (uint8) of this rank's shared heap, for a long-lived buffer moved there
    (DDP's buckets): where no segment has room, the new one is sized to it, so /dev/shm
    holds no more than the buffers. None where the job's engine has no heap;
    ``DDLShmError`` when /dev/shm cannot take it."""
    heap = _s().engine.heap
    if heap is None:
        return None
    return heap.malloc((nbytes,), np.uint8, exact=True)


def jobs_in_flight() -> int:
    """Jobs queued or running on ddl's workers, the job's and every group's: 0 when no
    collective anywhere can still read or write a tensor."""
    s = _s()
    with _lock:
        runtimes = {id(r): r for r in [s.runtime, *(g.runtime for g in s.groups)]}
    return sum(r.busy_when_settled() for r in runtimes.values())  # groups may share one


def in_shared_memory(arr: np.ndarray) -> bool | None:
    """Whether ``arr`` (C-contiguous) lives in this rank's shared heap, where peers read and
    write it in place; None where the job's engine has no heap (``ddl.malloc`` gives private
    memory there: several hosts, MPI, gloo)."""
    heap = _s().engine.heap
    if heap is None:
        return None
    return heap.locate(arr) != 0


# ------------------------------------------------------------------------ groups
def new_group(ranks, *, timeout: float | None = None) -> Group | None:
    """A group of the given global ranks (in that order: ``ranks[i]`` is the group's rank
    ``i``) for the ``group=`` argument of the collectives. Its members must call this, in
    the same order as their other group creations, and it returns when all have (waiting
    up to ``timeout`` seconds, default ``DDL_INIT_TIMEOUT``); other ranks may call it too
    and get None."""
    s = _s()
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
    _target(group)
    s = _s()
    with _lock:
        if group in s.groups:
            s.groups.remove(group)
    group.close()


def _target(group: Group | None) -> tuple[Any, int, int]:
    """(engine, rank, size) of the job, or of ``group``."""
    s = _session or _s()  # _s() raises when not initialized
    if group is None:
        return s.engine, s.world.rank, s.world.size
    if not isinstance(group, Group):
        raise DDLConfigError(f"group must be a ddl.Group from ddl.new_group, got {group!r}")
    if group.closed:
        raise DDLError(f"{group!r} was released (ddl.destroy_group or ddl.shutdown)")
    return group.engine, group.rank, group.size


def job_engine() -> Any:
    """The job's engine (None before ``init()``): for control steps that need none of the
    planning (one small host array of one dtype)."""
    s = _session
    return None if s is None else s.engine


# ------------------------------------------------------------------- collectives
def _routed(tensor: Any, group: Group | None, op: ReduceOp | None = None
            ) -> tuple[DeviceRouter, str] | None:
    """(router, backend) when a device engine takes ``tensor`` (torch CUDA tensors, in
    job-wide calls only: a group's calls stage through its host engine), else None."""
    if group is not None:
        return None
    devices = _s().devices
    backend = devices.backend_for(tensor, op)
    return (devices, backend) if backend else None


def dispatch(job: Callable[[], Any], name: str, async_: bool, group: Group | None = None):
    """Queue ``job`` behind the earlier work of the job (or of ``group``: each group has
    its own queue, as each torch process group has its own stream of work)."""
    runtime = (_session or _s()).runtime if group is None else group.runtime
    if async_:
        return runtime.submit(job, name)
    return runtime.run(job, name)


def _output(f: tensors.Flat, out: Any, inplace: bool, what: str) -> tuple[Any, tensors.Flat]:
    if inplace:
        return f.original, tensors.writable(f, what)
    if out is None:
        return tensors.empty_like(f)
    g = tensors.writable(tensors.flatten(out, name="out"), what, "out")
    if g.dtype != f.dtype or g.array.size != f.array.size:
        raise DDLConfigError(
            f"{what}: out has {g.dtype.name}[{g.array.size}] but the input is "
            f"{f.dtype.name}[{f.array.size}]"
        )
    return out, g


def plan_allreduce(tensor, op, out, inplace: bool, group: Group | None = None
                    ) -> Callable[[], Any]:
    engine, _, _ = _target(group)
    op = parse_op(op)
    if route := _routed(tensor, group, op):
        devices, backend = route
        return devices.plan_allreduce(backend, tensor, op, out, inplace)
    f = tensors.flatten(tensor)
    check_op(op, f.dtype)
    result, g = _output(f, out, inplace, "allreduce")
    src = f.array
    if not inplace and not tensors.same_memory(src, g.array) and tensors.overlaps(src, g.array):
        src = src.copy()

    def job():
        engine.allreduce(src, g.array, f.dtype, op, f.shape)
        g.write_back()
        return result

    return job


def plan_allreduce_into(sources: list, out, op, group: Group | None = None, *,
                         grouped: bool = False) -> Callable[[], Any]:
    """Allreduce the concatenation of ``sources`` (flattened, one dtype, CPU) into ``out``
    (a flat contiguous CPU buffer), or in place on the sources when ``out`` is None: a fused
    allreduce whose fusion buffer is never filled. The same bits, and the same steps on the
    wire, as an allreduce of the filled buffer, which a rank that joined (Horovod's join)
    runs instead; ``grouped``: the call is a grouped allreduce of these tensors, and their
    sizes are part of its identity (``grouped_layout``), so ranks that split the same total
    differently raise ``DDLMismatchError`` instead of reducing unrelated elements."""
    engine, _, _ = _target(group)
    op = parse_op(op)
    if not sources:
        raise DDLConfigError("fused allreduce of no tensors")
    if route := _routed(sources[0], group, op):
        devices, backend = route
        return devices.plan_fused_allreduce(backend, sources, out, op)
    parts = [tensors.flatten(t) for t in sources]
    dt, total = parts[0].dtype, sum(f.array.size for f in parts)
    check_op(op, dt)
    src = tensors.Pieces([f.array for f in parts])
    if out is None:
        for f in parts:
            tensors.writable(f, "fused allreduce")
        g, dst = None, src
        spans = sorted((f.array.__array_interface__["data"][0], f.array.nbytes) for f in parts)
        if any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:])):
            raise DDLConfigError("fused allreduce in place: two of the tensors share memory")
    else:
        g = tensors.writable(tensors.flatten(out, name="out"), "fused allreduce", "out")
        if g.staged:
            raise DDLConfigError("fused allreduce: out must be a contiguous CPU tensor or array")
        dst = g.array
    if any(f.dtype != dt for f in parts) or (g is not None and (g.dtype != dt
                                                                or g.array.size != total)):
        got = ", ".join(f"{f.dtype.name}[{f.array.size}]" for f in parts)
        into = f" into {g.dtype.name}[{g.array.size}]" if g is not None else ""
        raise DDLConfigError(f"fused allreduce of {got}{into}: dtypes or sizes differ")
    if g is not None:
        base = dst.__array_interface__["data"][0]
        for f, at in zip(parts, src.starts):
            # a source may already be its own slice of out (a gradient accumulated in place)
            if (tensors.overlaps(f.array, dst)
                    and f.array.__array_interface__["data"][0] - base != at * dt.itemsize):
                raise DDLConfigError("fused allreduce: a source overlaps out somewhere other "
                                     "than its own place in it")

    shape = grouped_layout([f.array.size for f in parts]) if grouped else (total,)

    def job():
        engine.allreduce(src, dst, dt, op, shape)
        if g is not None:
            return out
        for f in parts:
            f.write_back()
        return sources

    return job


def grouped_layout(sizes: list[int]) -> tuple[int, ...]:
    """The shape a grouped allreduce of tensors of ``sizes`` elements shows the engines'
    identity checks: ``(-len(sizes), *sizes)``. No tensor has a negative dimension, so it
    never equals a plain allreduce's shape, nor another split of the same total."""
    return (-len(sizes), *sizes)


def _rows_of(shape: tuple[int, ...], what: str) -> tuple[int, tuple[int, ...], int]:
    if not shape:
        raise DDLConfigError(f"{what} needs a tensor with at least one dimension, got a 0-d one")
    row_shape = tuple(shape[1:])
    row = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
    return shape[0], row_shape, row


def plan_allgather(tensor, group: Group | None = None) -> Callable[[], Any]:
    engine, _, _ = _target(group)
    if route := _routed(tensor, group):
        devices, backend = route
        _, row_shape, row = _rows_of(tuple(tensor.shape), "allgather")
        return devices.plan_allgather(backend, tensor, row_shape, row)
    f = tensors.flatten(tensor)
    _, row_shape, row = _rows_of(f.shape, "allgather")
    holder: list[Any] = []

    def alloc(counts: list[int]) -> np.ndarray:
        total = sum(counts)
        if row and any(c % row for c in counts):  # pragma: no cover - shapes are checked
            raise DDLError("allgather: element counts are not whole rows")
        obj, g = tensors.empty_like(f, (total // row if row else 0,) + row_shape)
        holder.append((obj, g))
        return g.array

    def job():
        engine.allgather(f.array, f.dtype, row_shape, alloc)
        obj, g = holder[0]
        g.write_back()
        return obj

    return job


def plan_broadcast(tensor, root_rank: int, inplace: bool, group: Group | None = None
                    ) -> Callable[[], Any]:
    engine, _, size = _target(group)
    try:
        root_rank = operator.index(root_rank)  # an int, numpy's too; not a float or a str
    except TypeError:
        raise DDLConfigError(f"broadcast: root_rank must be an int, got {root_rank!r}") from None
    if not 0 <= root_rank < size:
        raise DDLConfigError(f"broadcast: root_rank {root_rank} is outside 0..{size - 1}")
    if route := _routed(tensor, group):
        devices, backend = route
        return devices.plan_broadcast(backend, tensor, root_rank, inplace)
    f = tensors.flatten(tensor)
    if inplace:
        result, g = f.original, tensors.writable(f, "broadcast")
    else:
        result, g = tensors.empty_like(f)
        np.copyto(g.array, f.array)

    def job():
        engine.broadcast(g.array, f.dtype, root_rank, f.shape)
        g.write_back()
        return result

    return job


def split_rows(rows: int, n: int) -> list[int]:
    """How reduce_scatter splits dimension 0: as evenly as possible, lower ranks first."""
    return grid.even_split(rows, n)


def plan_reduce_scatter(tensor, op, group: Group | None = None) -> Callable[[], Any]:
    engine, rank, size = _target(group)
    op = parse_op(op)
    if route := _routed(tensor, group, op):
        devices, backend = route
        rows, row_shape, row = _rows_of(tuple(tensor.shape), "reduce_scatter")
        split = split_rows(rows, size)
        return devices.plan_reduce_scatter(backend, tensor, op, [c * row for c in split],
                                            (split[rank],) + row_shape)
    f = tensors.flatten(tensor)
    check_op(op, f.dtype)
    rows, row_shape, row = _rows_of(f.shape, "reduce_scatter")
    split = split_rows(rows, size)
    counts = [c * row for c in split]
    result, g = tensors.empty_like(f, (split[rank],) + row_shape)

    def job():
        engine.reduce_scatter(f.array, g.array, f.dtype, op, f.shape, counts)
        g.write_back()
        return result

    return job


def _planned(make: Callable[[], Callable[[], Any]], tensor: Any, op: Any, name: str,
             group: Group | None) -> Callable[[], Any]:
    """``make()``'s plan. When planning refuses the call on this rank (an op the dtype does
    not allow, an ``out`` of the wrong size, a root outside the group...), the refusal still
    takes the call's place among the peers' collectives before it is raised: the engine's
    ``refuse`` step, whose record no collective has, queued behind this rank's earlier
    work. Peers that ran the call then raise ``DDLMismatchError`` instead of pairing with
    this rank's next call (which gave every later call the wrong partner, silently); peers
    that refused too meet the step and raise their own error. Device-routed calls (NCCL)
    have no such step."""
    try:
        return make()
    except Exception as exc:  # planning has no side effects: any refusal is one
        _refuse_collectively(exc, tensor, op, name, group)
        raise


def _refuse_collectively(exc: Exception, tensor: Any, op: Any, name: str,
                         group: Group | None) -> None:
    if _session is None:
        return  # not initialized: there are no peers yet
    try:
        engine, rank, size = _target(group)
    except DDLError:  # a released group, a foreign object: it has no peers to meet
        return
    try:  # where the plan would have sent it: a device engine's call has no refusal step
        first = tensor[0] if isinstance(tensor, list) and tensor else tensor
        routed = _routed(first, group, parse_op(op) if op is not None else None) is not None
    except Exception:  # noqa: BLE001 - not a tensor, not an op: the host engine's call
        routed = False
    refuse = getattr(engine, "refuse", None)
    if refuse is None or size < 2 or routed:
        return
    try:
        dispatch(refuse, name, False, group)
    except DDLMismatchError:
        exc.add_note(f"rank {rank}: the other ranks ran {name} and were told (each raises "
                     "DDLMismatchError)")
    except DDLError as other:
        exc.add_note(f"rank {rank}: telling the other ranks failed too: {other}")


# ------------------------------------------------------------------ the spellings
# Every public spelling of a collective is a thin ``def`` over one ``plan_*``: ``x`` blocks
# and returns a new result, ``x_`` works in place, ``x_async``/``x_async_`` return a Handle
# at once (``synchronize``/``poll``, or ``handle.wait()``). Each only names its plan.
OpArg = ReduceOp | str


def _issue(make: Callable[[], Callable[[], Any]], first: Any, op: Any, label: str,
           name: str | None, group: Group | None, async_: bool) -> Any:
    """Queue ``make()``'s plan as ``name`` (default: the spelling's ``label``)."""
    label = name or label
    return dispatch(_planned(make, first, op, label, group), label, async_, group)


def allreduce(tensor: Any, op: OpArg = Average, *, out: Any = None, name: str | None = None,
              group: Group | None = None) -> Any:
    """Reduce ``tensor`` over all ranks and return the result (a new tensor, or ``out``)."""
    return _issue(lambda: plan_allreduce(tensor, op, out, False, group), tensor, op,
                  "allreduce", name, group, False)


def allreduce_(tensor: Any, op: OpArg = Average, *, name: str | None = None,
               group: Group | None = None) -> Any:
    """In-place allreduce; returns ``tensor``."""
    return _issue(lambda: plan_allreduce(tensor, op, None, True, group), tensor, op,
                  "allreduce_", name, group, False)


def allreduce_async(tensor: Any, op: OpArg = Average, *, out: Any = None,
                    name: str | None = None, group: Group | None = None) -> Handle:
    """``allreduce``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return _issue(lambda: plan_allreduce(tensor, op, out, False, group), tensor, op,
                  "allreduce_async", name, group, True)


def allreduce_async_(tensor: Any, op: OpArg = Average, *, name: str | None = None,
                     group: Group | None = None) -> Handle:
    """``allreduce_``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return _issue(lambda: plan_allreduce(tensor, op, None, True, group), tensor, op,
                  "allreduce_async_", name, group, True)


def grouped_allreduce_(tensors: Sequence[Any], op: OpArg = Average, *, name: str | None = None,
                       group: Group | None = None) -> Any:
    """Allreduce several tensors of one dtype in place, as one fused collective: the same
    steps and bits as an allreduce of their concatenation, but no fusion buffer is filled
    (each tensor is staged from where it lives). Every rank passes the same sizes (they are
    part of the call's identity). Returns ``tensors``."""
    tensors = list(tensors)  # read once: the plan and a refusal both look at them
    return _issue(lambda: plan_allreduce_into(tensors, None, op, group, grouped=True),
                  tensors, op, "grouped_allreduce_", name, group, False)


def grouped_allreduce_async_(tensors: Sequence[Any], op: OpArg = Average, *,
                             name: str | None = None, group: Group | None = None) -> Handle:
    """``grouped_allreduce_``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    tensors = list(tensors)
    return _issue(lambda: plan_allreduce_into(tensors, None, op, group, grouped=True),
                  tensors, op, "grouped_allreduce_async_", name, group, True)


def allgather(tensor: Any, *, name: str | None = None, group: Group | None = None) -> Any:
    """Concatenate every rank's tensor along dimension 0 (first dimensions may differ)."""
    return _issue(lambda: plan_allgather(tensor, group), tensor, None, "allgather", name,
                  group, False)


def allgather_async(tensor: Any, *, name: str | None = None,
                    group: Group | None = None) -> Handle:
    """``allgather``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return _issue(lambda: plan_allgather(tensor, group), tensor, None, "allgather_async", name,
                  group, True)


def broadcast(tensor: Any, root_rank: int = 0, *, name: str | None = None,
              group: Group | None = None) -> Any:
    """Return a copy of ``root_rank``'s tensor on every rank."""
    return _issue(lambda: plan_broadcast(tensor, root_rank, False, group), tensor, None,
                  "broadcast", name, group, False)


def broadcast_(tensor: Any, root_rank: int = 0, *, name: str | None = None,
               group: Group | None = None) -> Any:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns ``tensor``."""
    return _issue(lambda: plan_broadcast(tensor, root_rank, True, group), tensor, None,
                  "broadcast_", name, group, False)


def broadcast_async(tensor: Any, root_rank: int = 0, *, name: str | None = None,
                    group: Group | None = None) -> Handle:
    """``broadcast``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return _issue(lambda: plan_broadcast(tensor, root_rank, False, group), tensor, None,
                  "broadcast_async", name, group, True)


def broadcast_async_(tensor: Any, root_rank: int = 0, *, name: str | None = None,
                     group: Group | None = None) -> Handle:
    """``broadcast_``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return _issue(lambda: plan_broadcast(tensor, root_rank, True, group), tensor, None,
                  "broadcast_async_", name, group, True)


def reduce_scatter(tensor: Any, op: OpArg = Average, *, name: str | None = None,
                   group: Group | None = None) -> Any:
    """Reduce over ranks, then return this rank's block of dimension 0 (``split_rows``)."""
    return _issue(lambda: plan_reduce_scatter(tensor, op, group), tensor, op, "reduce_scatter",
                  name, group, False)


def reduce_scatter_async(tensor: Any, op: OpArg = Average, *, name: str | None = None,
                         group: Group | None = None) -> Handle:
    """``reduce_scatter``, queued: returns a Handle at once (``synchronize``/``poll``,
    or ``handle.wait()`` for the result)."""
    return _issue(lambda: plan_reduce_scatter(tensor, op, group), tensor, op,
                  "reduce_scatter_async", name, group, True)


# The public spellings of the collectives, blocking ones first then their queued twins.
SPELLINGS: tuple[Callable[..., Any], ...] = (
    allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce_,
    grouped_allreduce_async_, allgather, allgather_async, broadcast, broadcast_,
    broadcast_async, broadcast_async_, reduce_scatter, reduce_scatter_async)


def barrier(*, group: Group | None = None) -> None:
    engine, _, _ = _target(group)
    dispatch(engine.barrier, "barrier", False, group)


def synchronize(handle: Handle) -> Any:
    """Wait for an ``*_async`` operation and return its result (raises its error)."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when the ``*_async`` operation has finished."""
    return handle.poll()
