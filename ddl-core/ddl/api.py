"""The public, Horovod-shaped API of the ddl core (numpy arrays and torch tensors).

Each collective has one implementation (``_plan_*``, which returns the work as a closure);
the blocking, in-place and ``_async`` spellings below are thin wrappers around it.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import config, grid, options, tensors
from .devices import DeviceRouter
from .engines.local import LocalEngine
from .errors import DDLConfigError, DDLError
from .ops import Average, ReduceOp, check_op, parse_op
from .runtime import Handle, Runtime
from .topology import World, world_from_env

_lock = threading.Lock()
_world: World | None = None
_engine: Any = None
_runtime: Runtime | None = None
_options: options.Options | None = None
_devices: DeviceRouter | None = None


# ------------------------------------------------------------------------ lifecycle
def init() -> None:
    """Join the job described by the launch environment (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, ...; see docs/api.md). Without one, this process is a 1-rank world.
    Calling it again is a no-op."""
    global _world, _engine, _runtime, _options, _devices
    with _lock:
        if _world is not None:
            return
        world = world_from_env()
        opts = options.parse(config.get("DDL_OPTIONS"))
        options.check_grid(opts, world.size)
        engine = _make_engine(world, opts)
        if opts.dbg_level and world.rank == 0:
            import sys

            desc = engine.describe() if hasattr(engine, "describe") else engine.name
            print(f"[ddl] {world.size} ranks on {world.num_hosts} host(s), engine "
                  f"{engine.name}: {desc}; options {opts.to_string() or '(none)'}",
                  file=sys.stderr, flush=True)
        _world, _engine, _runtime, _options = world, engine, Runtime(), opts
        _devices = DeviceRouter(world, opts, _rendezvous)


def _rendezvous():
    """ddl's TCP store: the multi-host engine's when it has one, else one made now (all
    ranks get here at the same point: the first collective on a device tensor)."""
    ctx = getattr(_engine, "ctx", None)
    store = getattr(ctx, "store", None)
    if store is not None:
        return store
    from .engines.gloo import GlooContext

    return GlooContext(_world.rank, _world.size, config.get("MASTER_ADDR"), _port(),
                       config.get("DDL_TIMEOUT")).store


def _shm_kwargs() -> dict:
    return dict(
        init_timeout=config.get("DDL_INIT_TIMEOUT"),
        slot_bytes=config.get("DDL_SHM_SLOT_BYTES"),
        max_bytes=config.get("DDL_SHM_MAX_BYTES"),
        small_bytes=config.get("DDL_SHM_SMALL_BYTES"),
        wait_policy=config.get("DDL_SHM_WAIT"),
        heap_bytes=config.get("DDL_SHM_HEAP_BYTES"),
        fences=config.get("DDL_SHM_FENCES"),
    )


def _make_engine(world: World, opts: options.Options):
    """Local for one rank; the shared-memory engine when every rank is on this host (any
    grid inside one host is the same set of ranks); otherwise the multi-dimensional engine
    over shared memory inside hosts and Gloo across them."""
    if world.size == 1:
        return LocalEngine()
    g = grid.plan(world.rank, world.size, world.local_size, opts)
    if world.local_size == world.size and all(d.intra_host for d in g.dims):
        from .engines.shm import ShmEngine

        return ShmEngine(job_id=world.job_id, host_index=world.host_index,
                         local_rank=world.local_rank, local_size=world.local_size,
                         global_rank=world.rank, timeout=config.get("DDL_TIMEOUT"),
                         **_shm_kwargs())
    from .engines.multihost import MultiHostEngine

    port = _port()
    transport = config.get("DDL_TRANSPORT")
    if transport == "auto":
        transport = "mpi" if world.launched_by_mpi and _have("mpi4py") else "gloo"
    return MultiHostEngine(world, opts, transport=transport, addr=config.get("MASTER_ADDR"),
                           port=port,
                           timeout=config.get("DDL_TIMEOUT"),
                           chunk_bytes=config.get("DDL_CHUNK_BYTES"),
                           shm_kwargs=_shm_kwargs())


def _port() -> int:
    return config.get("DDL_PORT") or config.get("MASTER_PORT") + 1


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
    global _world, _engine, _runtime, _devices
    with _lock:
        if _world is None:
            return
        try:
            if _runtime is not None:
                _runtime.close()
        finally:
            try:
                _devices.close()
            finally:
                _engine.close()
                _world, _engine, _runtime, _devices = None, None, None, None


atexit.register(shutdown)


def is_initialized() -> bool:
    return _world is not None


def _w() -> World:
    if _world is None:
        raise DDLError("ddl is not initialized: call ddl.init() first")
    return _world


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
    _w()
    return _options


def engine_name() -> str:
    _w()
    return _engine.name


def malloc(shape, dtype=np.float32) -> np.ndarray:
    """A numpy array in this host's shared memory (IBM pyddl.malloc). Collectives on such
    arrays skip the staging copies; wrap with ``torch.from_numpy`` for a torch tensor."""
    _w()
    if _engine.heap is None:
        return np.empty(shape, dtype=dtype)
    return _engine.heap.malloc(shape, dtype)


# ------------------------------------------------------------------- collectives
def _dispatch(job: Callable[[], Any], name: str, async_: bool):
    if async_:
        return _runtime.submit(job, name)
    return _runtime.run(job, name)


def _output(f: tensors.Flat, out: Any, inplace: bool, what: str) -> tuple[Any, tensors.Flat]:
    if inplace:
        return f.original, f
    if out is None:
        return tensors.empty_like(f)
    g = tensors.flatten(out, name="out")
    if g.dtype != f.dtype or g.array.size != f.array.size:
        raise DDLConfigError(
            f"{what}: out has {g.dtype.name}[{g.array.size}] but the input is "
            f"{f.dtype.name}[{f.array.size}]"
        )
    return out, g


def _plan_allreduce(tensor, op, out, inplace: bool) -> Callable[[], Any]:
    _w()
    op = parse_op(op)
    backend = _devices.backend_for(tensor, op)
    if backend:
        return _devices.plan_allreduce(backend, tensor, op, out, inplace)
    f = tensors.flatten(tensor)
    check_op(op, f.dtype)
    result, g = _output(f, out, inplace, "allreduce")
    src = f.array
    if not inplace and not tensors.same_memory(src, g.array) and tensors.overlaps(src, g.array):
        src = src.copy()
    engine = _engine

    def job():
        engine.allreduce(src, g.array, f.dtype, op, f.shape)
        g.write_back()
        return result

    return job


def allreduce(tensor, op: ReduceOp | str = Average, *, out=None, name: str | None = None):
    """Reduce ``tensor`` over all ranks and return the result (a new tensor, or ``out``)."""
    return _dispatch(_plan_allreduce(tensor, op, out, False), name or "allreduce", False)


def allreduce_(tensor, op: ReduceOp | str = Average, *, name: str | None = None):
    """In-place allreduce; returns ``tensor``."""
    return _dispatch(_plan_allreduce(tensor, op, None, True), name or "allreduce_", False)


def allreduce_async(tensor, op: ReduceOp | str = Average, *, out=None,
                    name: str | None = None) -> Handle:
    return _dispatch(_plan_allreduce(tensor, op, out, False), name or "allreduce_async", True)


def allreduce_async_(tensor, op: ReduceOp | str = Average, *, name: str | None = None) -> Handle:
    return _dispatch(_plan_allreduce(tensor, op, None, True), name or "allreduce_async_", True)


def _rows_of(shape: tuple[int, ...], what: str) -> tuple[int, tuple[int, ...], int]:
    if not shape:
        raise DDLConfigError(f"{what} needs a tensor with at least one dimension, got a 0-d one")
    row_shape = tuple(shape[1:])
    row = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
    return shape[0], row_shape, row


def _plan_allgather(tensor) -> Callable[[], Any]:
    _w()
    backend = _devices.backend_for(tensor)
    if backend:
        _, row_shape, row = _rows_of(tuple(tensor.shape), "allgather")
        return _devices.plan_allgather(backend, tensor, row_shape, row)
    f = tensors.flatten(tensor)
    _, row_shape, row = _rows_of(f.shape, "allgather")
    engine = _engine
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


def allgather(tensor, *, name: str | None = None):
    """Concatenate every rank's tensor along dimension 0 (first dimensions may differ)."""
    return _dispatch(_plan_allgather(tensor), name or "allgather", False)


def allgather_async(tensor, *, name: str | None = None) -> Handle:
    return _dispatch(_plan_allgather(tensor), name or "allgather_async", True)


def _plan_broadcast(tensor, root_rank: int, inplace: bool) -> Callable[[], Any]:
    w = _w()
    if not 0 <= root_rank < w.size:
        raise DDLConfigError(f"broadcast: root_rank {root_rank} is outside 0..{w.size - 1}")
    backend = _devices.backend_for(tensor)
    if backend:
        return _devices.plan_broadcast(backend, tensor, root_rank, inplace)
    f = tensors.flatten(tensor)
    if inplace:
        result, g = f.original, f
    else:
        result, g = tensors.empty_like(f)
        np.copyto(g.array, f.array)
    engine = _engine

    def job():
        engine.broadcast(g.array, f.dtype, root_rank, f.shape)
        g.write_back()
        return result

    return job


def broadcast(tensor, root_rank: int = 0, *, name: str | None = None):
    """Return a copy of ``root_rank``'s tensor on every rank."""
    return _dispatch(_plan_broadcast(tensor, root_rank, False), name or "broadcast", False)


def broadcast_(tensor, root_rank: int = 0, *, name: str | None = None):
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns ``tensor``."""
    return _dispatch(_plan_broadcast(tensor, root_rank, True), name or "broadcast_", False)


def broadcast_async(tensor, root_rank: int = 0, *, name: str | None = None) -> Handle:
    return _dispatch(_plan_broadcast(tensor, root_rank, False), name or "broadcast_async", True)


def broadcast_async_(tensor, root_rank: int = 0, *, name: str | None = None) -> Handle:
    return _dispatch(_plan_broadcast(tensor, root_rank, True), name or "broadcast_async_", True)


def split_rows(rows: int, n: int) -> list[int]:
    """How reduce_scatter splits dimension 0: as evenly as possible, lower ranks first."""
    return [rows // n + (1 if j < rows % n else 0) for j in range(n)]


def _plan_reduce_scatter(tensor, op) -> Callable[[], Any]:
    w = _w()
    op = parse_op(op)
    backend = _devices.backend_for(tensor, op)
    if backend:
        rows, row_shape, row = _rows_of(tuple(tensor.shape), "reduce_scatter")
        split = split_rows(rows, w.size)
        return _devices.plan_reduce_scatter(backend, tensor, op, [c * row for c in split],
                                            (split[w.rank],) + row_shape)
    f = tensors.flatten(tensor)
    check_op(op, f.dtype)
    rows, row_shape, row = _rows_of(f.shape, "reduce_scatter")
    split = split_rows(rows, w.size)
    counts = [c * row for c in split]
    result, g = tensors.empty_like(f, (split[w.rank],) + row_shape)
    engine = _engine

    def job():
        engine.reduce_scatter(f.array, g.array, f.dtype, op, f.shape, counts)
        g.write_back()
        return result

    return job


def reduce_scatter(tensor, op: ReduceOp | str = Average, *, name: str | None = None):
    """Reduce over ranks, then return this rank's block of dimension 0 (``split_rows``)."""
    return _dispatch(_plan_reduce_scatter(tensor, op), name or "reduce_scatter", False)


def reduce_scatter_async(tensor, op: ReduceOp | str = Average, *,
                         name: str | None = None) -> Handle:
    return _dispatch(_plan_reduce_scatter(tensor, op), name or "reduce_scatter_async", True)


def barrier() -> None:
    _w()
    engine = _engine
    _runtime.run(engine.barrier, "barrier")


def synchronize(handle: Handle) -> Any:
    """Wait for an ``*_async`` operation and return its result (raises its error)."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when the ``*_async`` operation has finished."""
    return handle.poll()
