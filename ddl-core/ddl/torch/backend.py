"""The ``ddl`` backend for ``torch.distributed``.

    import ddl.torch                     # registers the backend
    torch.distributed.init_process_group("ddl", init_method="env://")

A Python subclass of ``torch.distributed.ProcessGroup`` whose collectives are the ddl core's
``*_async`` calls. The core runs them in submission order on its worker thread, which also
completes each ``Work``'s future when its last handle finishes, so DDP's bucket allreduces
overlap with the rest of backward exactly as they do on gloo.

Groups: the default group (and ``new_group()`` of every rank in order) runs on the job's
engine; ``new_group`` of other ranks gets a ``ddl.new_group`` of its own: shared memory when
its members share a host, the job's network transport otherwise.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import ddl

from .. import timeline as _tl
from ..errors import DDLConfigError
from ..hvd.arrays import torch_writes
from . import collectives
from .shared_buckets import SharedBuckets

BACKEND_NAME = "ddl"

# DDP's reused buckets move into ddl's shared heap (shared_buckets.py)
_shared = SharedBuckets()

_REDUCE_OPS: dict[Any, ddl.ReduceOp] = {
    dist.ReduceOp.SUM: ddl.Sum,
    dist.ReduceOp.AVG: ddl.Average,
    dist.ReduceOp.PRODUCT: ddl.Product,
    dist.ReduceOp.MIN: ddl.Min,
    dist.ReduceOp.MAX: ddl.Max,
}


def _reduce_op(opts: Any, call: str) -> ddl.ReduceOp:
    op = opts if isinstance(opts, dist.ReduceOp) else getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    # ReduceOp instances compare by kind but do not hash by it: look up by equality.
    for theirs, ours in _REDUCE_OPS.items():
        if op == theirs:
            return ours
    raise NotImplementedError(
        f"ddl backend: {call} with {op} is not supported (use SUM, AVG, PRODUCT, MIN or MAX)"
    )


def _for_dtype(op: ddl.ReduceOp, t: torch.Tensor) -> tuple[ddl.ReduceOp, bool]:
    """The op the core runs for ``t``, and whether the result is then divided by the group
    size: AVG of an integer tensor is a SUM divided afterwards, truncating toward zero, as
    NCCL computes it (PyTorch Lightning averages int64 counters with ``sync_dist=True``)."""
    if op is ddl.Average and not (t.is_floating_point() or t.is_complex()
                                  or t.dtype == torch.bool):
        return ddl.Sum, True
    return op, False


def _divide_(t: torch.Tensor, size: int) -> None:
    with torch_writes(t):
        t.copy_(torch.div(t, size, rounding_mode="trunc"))


class DDLWork(dist.Work):
    """A pending collective; ``get_future()`` yields the output tensors."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self._what = what
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._future.wait()
        except Exception:
            # The future carries the error as torch's RuntimeError; the caller of wait()
            # gets the core's own (DDLPeerError, DDLMismatchError...) with rank and operation.
            if self._error is not None:
                raise self._error from None
            raise
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._future.value()

    def __repr__(self) -> str:
        return f"<DDLWork {self._what} {'done' if self._future.done() else 'pending'}>"


def _make_work(what: str, finish: Callable[[], Any]) -> tuple[DDLWork, torch.futures.Future]:
    """A Work whose future runs ``finish`` once the returned trigger future is set.

    Errors must enter the future by raising inside a ``then`` callback: a future failed with
    ``set_exception`` from Python crashes DDP's reducer (torch 2.13) when it reads it.
    """
    work = DDLWork(what)
    trigger: torch.futures.Future = torch.futures.Future()

    def run(_: torch.futures.Future) -> Any:
        try:
            return finish()
        except BaseException as exc:
            work._error = exc
            raise

    work._future = trigger.then(run)
    if _tl.recorder is not None or _tl.torch_profiler() is not None:
        # a range from issue to completion, as gloo's and NCCL's Works have ("ddl:<op>")
        work._future = _tl.async_range(what, work._future)
    return work, trigger


def _work(handles: Sequence[ddl.Handle], finish: Callable[[], Any], what: str) -> DDLWork:
    """A Work whose future completes when the last of ``handles`` finishes, from the thread
    that finishes it (ddl's worker): no extra thread has to wake up on a busy machine."""

    def run() -> Any:
        for h in handles:
            h.wait()
        return finish()

    work, trigger = _make_work(what, run)
    remaining = [len(handles)]
    lock = threading.Lock()

    def one_done(_: ddl.Handle) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            trigger.set_result(None)

    if not handles:
        trigger.set_result(None)
    for h in handles:
        h.add_done_callback(one_done)
    return work


def _done(result: Any, what: str) -> DDLWork:
    work, trigger = _make_work(what, lambda: result)
    trigger.set_result(None)
    return work


def _failed(exc: BaseException, what: str) -> DDLWork:
    def fail() -> Any:
        raise exc

    work, trigger = _make_work(what, fail)
    trigger.set_result(None)
    return work


def _guarded(fn: Callable[..., DDLWork]) -> Callable[..., DDLWork]:
    """After a peer failure the core refuses new work at once; hand that error back in the
    Work, where DDP and ``work.wait()`` look for it, rather than raising from inside DDP's
    autograd hook."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> DDLWork:
        try:
            return fn(*args, **kwargs)
        except ddl.DDLError as exc:
            return _failed(exc, fn.__name__)

    return wrapper


def _unsupported(call: str, hint: str = "") -> NotImplementedError:
    return NotImplementedError(
        f"ddl backend: {call} is not supported" + (f"; {hint}" if hint else "")
    )


class DDLProcessGroup(dist.ProcessGroup):
    """A process group backed by the ddl core: the job's ranks, or a ``ddl.Group``."""

    def __init__(self, rank: int, size: int, timeout: timedelta | None = None,
                 group: ddl.Group | None = None, p2p: Any = None) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._timeout = timeout
        self._group = group
        self._p2p = p2p  # a gloo group of the same ranks: the core has no send/recv

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    # torch names a group through its registered C++ backends, and a Python process group
    # has none: keep the name here, or destroy_process_group(group) cannot find it.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_group_name", "")

    def name(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        ranks = f", ranks={list(self._group.ranks)}" if self._group is not None else ""
        return f"DDLProcessGroup(rank={self._rank}, size={self._size}{ranks})"

    # ---------------------------------------------------------------- allreduce
    def _allreduce(self, tensors: Sequence[torch.Tensor], op: ddl.ReduceOp,
                   what: str) -> DDLWork:
        handles, divided = [], []
        shared = _shared if self._group is None else None  # the job's heap: default group
        for t in tensors:
            engine_op, divide = _for_dtype(op, t)
            if shared is not None:  # DDP's buckets: into the shared heap, where they qualify
                shared.move_if_reused(t)
            h = ddl.allreduce_async_(t, engine_op, name=f"torch.{what}", group=self._group)
            if shared is not None:
                shared.track(t, h)
            handles.append(h)
            if divide:
                divided.append(t)

        def finish() -> list:
            for t in divided:
                _divide_(t, self._size)
            return list(tensors)

        return _work(handles, finish, what)

    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> DDLWork:
        return self._allreduce(tensors, _reduce_op(opts, "allreduce"), "allreduce")

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> DDLWork:
        return self._allreduce(tensors, _reduce_op(opts, "allreduce_coalesced"),
                               "allreduce_coalesced")

    # ---------------------------------------------------------------- broadcast
    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> DDLWork:
        root = getattr(opts, "rootRank", 0) if opts is not None else 0
        handles = [ddl.broadcast_async_(t, root, name="torch.broadcast",
                                        group=self._group) for t in tensors]
        return _work(handles, lambda: list(tensors), "broadcast")

    # ---------------------------------------------------------------- allgather
    def allgather(self, output_tensors: Sequence[Sequence[torch.Tensor]],
                  input_tensors: Sequence[torch.Tensor], opts: Any = None) -> DDLWork:
        pending = []
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != self._size:
                raise DDLConfigError(
                    f"allgather: {len(outs)} output tensors for {self._size} ranks")
            pending.append((outs, ddl.allgather_async(inp.reshape(1, -1),
                                                      name="torch.allgather", group=self._group)))

        def finish():
            with torch_writes(*(o for outs, _ in pending for o in outs)):
                for outs, h in pending:
                    rows = h.wait()
                    for out, row in zip(outs, rows):
                        out.copy_(row.view(out.shape))
            return [o for outs, _ in pending for o in outs]

        return _work([h for _, h in pending], finish, "allgather")

    def allgather_coalesced(self, output_lists: Sequence[Sequence[torch.Tensor]],
                            input_list: Sequence[torch.Tensor], opts: Any = None) -> DDLWork:
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> DDLWork:
        h = ddl.allgather_async(input.reshape(1, -1), name="torch.all_gather_into_tensor",
                                group=self._group)

        def finish():
            with torch_writes(output):
                output.copy_(h.wait().view(output.shape))
            return [output]

        return _work([h], finish, "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: Sequence[torch.Tensor],
                                        inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> DDLWork:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _chain(works, list(outputs), "allgather_into_tensor_coalesced")

    def all_gather_single_coalesced(self, outputs, inputs, opts: Any = None) -> DDLWork:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    # ----------------------------------------------------------- reduce_scatter
    def reduce_scatter(self, output_tensors: Sequence[torch.Tensor],
                       input_lists: Sequence[Sequence[torch.Tensor]],
                       opts: Any = None) -> DDLWork:
        op = _reduce_op(opts, "reduce_scatter")
        pending = []
        for out, ins in zip(output_tensors, input_lists):
            if len(ins) != self._size:
                raise DDLConfigError(f"reduce_scatter: {len(ins)} inputs for {self._size} ranks")
            stacked = torch.stack([i.reshape(-1) for i in ins])
            pending.append((out, ddl.reduce_scatter_async(stacked, _for_dtype(op, out)[0],
                                                           name="torch.reduce_scatter",
                                                           group=self._group)))
        return _work([h for _, h in pending], self._copy_rows(pending, op), "reduce_scatter")

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> DDLWork:
        op = _reduce_op(opts, "reduce_scatter_tensor")
        if input.numel() != output.numel() * self._size:
            raise DDLConfigError(f"reduce_scatter_tensor: input has {input.numel()} elements, "
                             f"expected {self._size} x {output.numel()}")
        pending = [(output, ddl.reduce_scatter_async(input.reshape(self._size, -1),
                                                     _for_dtype(op, input)[0],
                                                     name="torch.reduce_scatter_tensor",
                                                     group=self._group))]
        return _work([pending[0][1]], self._copy_rows(pending, op), "reduce_scatter_tensor")

    def _copy_rows(self, pending: list[tuple[torch.Tensor, ddl.Handle]], op: ddl.ReduceOp
                   ) -> Callable[[], list]:
        copy = _copy_rows(pending)

        def finish() -> list:
            outs = copy()
            for out in outs:
                if _for_dtype(op, out)[1]:
                    _divide_(out, self._size)
            return outs

        return finish

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts: Any = None) -> DDLWork:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _chain(works, list(outputs), "reduce_scatter_tensor_coalesced")

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts: Any = None) -> DDLWork:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    # ---------------------------------------------------- reduce, gather, scatter
    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> DDLWork:
        # An allreduce into a temporary: every rank's traffic is the same anyway on shared
        # memory, and only the root's tensor changes, as the reduce contract says.
        op = _reduce_op(opts, "reduce")
        root = opts.rootRank
        pending = [(t, ddl.allreduce_async(t, _for_dtype(op, t)[0], name="torch.reduce",
                                           group=self._group)) for t in tensors]

        def finish():
            with torch_writes(*tensors):
                for t, h in pending:
                    r = h.wait()
                    if self._rank == root:
                        t.copy_(r)
                        if _for_dtype(op, t)[1]:
                            _divide_(t, self._size)
            return list(tensors)

        return _work([h for _, h in pending], finish, "reduce")

    def gather(self, output_lists: Sequence[Sequence[torch.Tensor]],
               input_tensors: Sequence[torch.Tensor], opts: Any = None) -> DDLWork:
        root = opts.rootRank
        inp = input_tensors[0]
        h = ddl.allgather_async(inp.reshape(1, -1), name="torch.gather", group=self._group)

        def finish():
            rows = h.wait()
            if self._rank == root:
                with torch_writes(*output_lists[0]):
                    for out, row in zip(output_lists[0], rows):
                        out.copy_(row.view(out.shape))
            return list(output_lists[0]) if output_lists else []

        return _work([h], finish, "gather")

    def scatter(self, output_tensors: Sequence[torch.Tensor],
                input_lists: Sequence[Sequence[torch.Tensor]], opts: Any = None) -> DDLWork:
        root = opts.rootRank
        out = output_tensors[0]
        if self._rank == root:
            stacked = torch.stack([i.reshape(-1) for i in input_lists[0]])
        else:
            stacked = torch.empty((self._size, out.numel()), dtype=out.dtype)
        h = ddl.broadcast_async_(stacked, root, name="torch.scatter", group=self._group)

        def finish():
            with torch_writes(out):
                out.copy_(stacked[self._rank].view(out.shape))
            return [out]

        return _work([h], finish, "scatter")

    # ----------------------------------------------------------------- alltoall
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None,
                          input_split_sizes: Sequence[int] | None,
                          opts: Any = None) -> DDLWork:
        splits = list(input_split_sizes) if input_split_sizes else None
        result, _ = collectives.alltoall(input, splits, group=self._group)
        with torch_writes(output):
            output.copy_(result.view(output.shape))
        return _done([output], "all_to_all_single")

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: Sequence[torch.Tensor],
                 input_tensors: Sequence[torch.Tensor], opts: Any = None) -> DDLWork:
        flat = torch.cat([t.reshape(-1) for t in input_tensors])
        splits = [t.numel() for t in input_tensors]
        result, received = collectives.alltoall(flat, splits, group=self._group)
        with torch_writes(*output_tensors):
            off = 0
            for out, n in zip(output_tensors, received):
                out.copy_(result[off:off + n].view(out.shape))
                off += n
        return _done(list(output_tensors), "alltoall")

    # ------------------------------------------------------------------ barrier
    def barrier(self, opts: Any = None) -> DDLWork:
        # Queued behind earlier async work, like every other collective.
        h = ddl.allreduce_async_(torch.zeros(1), ddl.Sum, name="torch.barrier", group=self._group)
        return _work([h], lambda: [], "barrier")

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        ddl.barrier(group=self._group)

    # ------------------------------------------------------------- point-to-point
    def send(self, tensors, dst_rank, tag=0):
        return self._point_to_point("send").send(tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag=0):
        return self._point_to_point("recv").recv(tensors, src_rank, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._point_to_point("recv_anysource").recv_anysource(tensors, tag)

    def _point_to_point(self, call: str) -> Any:
        if self._p2p is None:
            raise _unsupported(f"{call} (point-to-point)",
                               "use a gloo group for point-to-point traffic")
        return self._p2p

    def shutdown(self) -> None:
        """``destroy_process_group``: release the ddl group (not the job's engine, which
        ``ddl.shutdown()`` releases) and the point-to-point group."""
        try:
            if self._group is not None and not self._group.closed:
                ddl.destroy_group(self._group)
        finally:
            if self._p2p is not None:
                self._p2p.shutdown()
                self._p2p = None

    # ------------------------------------------------------------ not supported

    def split_group(self, *args, **kwargs):
        raise _unsupported("split_group", "use torch.distributed.new_group")

    def merge_remote_group(self, *args, **kwargs):
        raise _unsupported("merge_remote_group")


for _name in ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "all_gather_single",
              "reduce_scatter", "reduce_scatter_single", "reduce", "gather", "scatter",
              "all_to_all_single", "alltoall", "barrier"):
    setattr(DDLProcessGroup, _name, _guarded(getattr(DDLProcessGroup, _name)))
DDLProcessGroup._allgather_base = DDLProcessGroup.all_gather_single
DDLProcessGroup._reduce_scatter_base = DDLProcessGroup.reduce_scatter_single
DDLProcessGroup.alltoall_base = DDLProcessGroup.all_to_all_single
del _name


def _copy_rows(pending: list[tuple[torch.Tensor, ddl.Handle]]) -> Callable[[], list]:
    def finish():
        with torch_writes(*(out for out, _ in pending)):
            for out, h in pending:
                out.copy_(h.wait().view(out.shape))
        return [out for out, _ in pending]

    return finish


def _chain(works: Sequence[DDLWork], result: list, what: str) -> DDLWork:
    def finish() -> list:
        for w in works:
            w.wait()
        return result

    work, trigger = _make_work(what, finish)
    torch.futures.collect_all([w.get_future() for w in works]).add_done_callback(
        lambda _: trigger.set_result(None))
    return work


def create_process_group(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """The creator ``torch.distributed`` calls for ``init_process_group("ddl")`` and for
    ``new_group(backend="ddl")``."""
    ddl.init()
    if size > ddl.size():
        raise ddl.DDLConfigError(
            f"torch.distributed asks for a group of {size} ranks but the ddl job has "
            f"{ddl.size()} (WORLD_SIZE): launch with ddlrun -n {size}"
        )
    group = None
    if size == ddl.size():
        if rank != ddl.rank():
            raise ddl.DDLConfigError(
                f"torch.distributed gives this process rank {rank} but the launch environment "
                f"says RANK={ddl.rank()}: pass init_method='env://' (or no rank/world_size) "
                "to init_process_group"
            )
    else:
        # Another set of ranks: torch calls this on the members only, with a store of
        # their own, through which they learn each other's job rank (torch's group rank i
        # is members[i]) and then make the ddl group.
        store.set(f"ddl/member/{rank}", str(ddl.rank()))
        members = [int(store.get(f"ddl/member/{i}")) for i in range(size)]
        group = ddl.new_group(members, timeout=timeout.total_seconds())
    # send/recv: the core has no point-to-point; a gloo group of the same ranks, made now
    # (every member is here), carries it
    p2p = dist.ProcessGroupGloo(dist.PrefixStore("ddl/p2p/", store), rank, size, timeout)
    if group is None:
        _shared.configure()
    return DDLProcessGroup(rank, size, timeout, group, p2p)


def register() -> None:
    """Register the ``ddl`` backend (idempotent; ``import ddl.torch`` does it)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cpu", "cuda"])
