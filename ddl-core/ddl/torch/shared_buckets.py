"""DDP's gradient buckets move into ddl's shared heap, so peers reduce them in place.

A tensor in ddl's heap (``ddl.malloc``) is reduced where it lives: two synchronisations
for the whole call, no copy into the staging slots and none back. DDP's buckets are
torch's own memory, allocated once and handed to every backward's allreduce, so on the
shared-memory engine each call staged them chunk by chunk, one synchronisation per chunk:
on a loaded host each synchronisation waits for the peer's thread to be scheduled, which is
most of what DDP's exposed communication cost (docs/performance.md).

The backend therefore moves such a buffer into the heap the second time it sees it, on
ddl's worker, in the same job as its allreduce (so after every earlier collective): a heap
block of the storage's size takes its bytes, and the two storages swap their memory
(``UntypedStorage._swap_data_ptr_``), so every view of the storage (DDP's bucket views, the
gradients with ``gradient_as_bucket_view``) follows, and the private memory is released.
Only buffers that cannot be observed moving are taken:

- an allreduce issued during a backward pass (where DDP and its comm hooks run),
- a contiguous CPU tensor that spans its whole storage, of ``DDL_TORCH_SHARE_BYTES`` or
  more, seen before (DDP's buckets are reused; a fresh tensor each step stays where it is),
- while /dev/shm keeps a quarter of its size free after it.

A numpy array taken from such a tensor earlier (``p.grad.numpy()`` with
``gradient_as_bucket_view``) would keep the old memory's address; DDP invalidates those
itself when it rebuilds its buckets after the first step, and docs/pytorch.md says so.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

import ddl

from .. import config
from ..api import _planned, dispatch, in_shared_memory, plan_allreduce, shared_block
from ..engines import segments

_log = logging.getLogger("ddl")

# How many storages are remembered as seen once; DDP has a handful of buckets.
_REMEMBERED = 256
# A buffer moves only while /dev/shm keeps this share free after it: DataLoader workers,
# torch.multiprocessing and other jobs on the host need it too, and a full /dev/shm fails
# them (a container's is often small).
KEEP_FREE = 0.25


def _in_backward() -> bool:
    """Whether this thread runs inside a backward pass (torch's own private probe; a torch
    without it moves nothing)."""
    probe = getattr(torch._C, "_current_graph_task_id", None)
    return probe is not None and probe() != -1


def _key(t: torch.Tensor) -> tuple[int, int, int]:
    s = t.untyped_storage()
    return s._cdata, s.data_ptr(), s.nbytes()


class SharedBuckets:
    """Decides, per allreduce, whether its tensor moves into the heap, and moves it."""

    def __init__(self) -> None:
        self.min_bytes = 0  # nothing moves until configure()
        self.moved = 0  # buffers moved so far (tests and the timeline read it)
        self._seen: OrderedDict[tuple[int, int, int], None] = OrderedDict()
        self._lock = threading.Lock()
        self._refused = False  # the heap could not grow: stop trying

    def configure(self, min_bytes: int | None = None) -> None:
        """Start afresh (a new process group, after ``ddl.init()``): buffers of at least
        ``min_bytes`` move (default ``DDL_TORCH_SHARE_BYTES``; 0: none)."""
        if min_bytes is None:
            min_bytes = config.get("DDL_TORCH_SHARE_BYTES")
        if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
            min_bytes = 0  # a torch without it (private API): buffers stay, staged
        with self._lock:
            self.min_bytes = min_bytes
            self._seen.clear()
            self._refused = False

    def _eligible(self, t: torch.Tensor) -> bool:
        if (self._refused or self.min_bytes <= 0 or t.device.type != "cpu"
                or t.layout != torch.strided):
            return False
        nbytes = t.numel() * t.element_size()
        return (nbytes >= self.min_bytes and t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == nbytes and _in_backward())

    def _second_sight(self, t: torch.Tensor) -> bool:
        key = _key(t)
        with self._lock:
            if key in self._seen:
                del self._seen[key]
                return True
            self._seen[key] = None
            if len(self._seen) > _REMEMBERED:
                self._seen.popitem(last=False)
            return False

    def allreduce_async_(self, t: torch.Tensor, op: ddl.ReduceOp, name: str
                         ) -> ddl.Handle | None:
        """If ``t`` qualifies (see the module's doc): move it into the heap and allreduce it
        there in place, both in one job on the job's worker, and return its handle. The
        move runs after every earlier collective (one may still write ``t``), and if it
        fails the collective does not run on garbage: this rank raises and its peers time
        out naming it. None: ``t`` stays where it is (the caller sends it as usual)."""
        if not self._eligible(t) or not self._second_sight(t):
            return None
        if in_shared_memory(t.detach().view(-1).view(torch.uint8).numpy()) is not False:
            return None  # already there, or no heap on this engine
        nbytes = t.numel() * t.element_size()
        total, free = segments.space()
        if free - nbytes < total * KEEP_FREE:
            return None  # leave /dev/shm to DataLoader workers and the rest of the host
        try:
            heap = shared_block(nbytes)
        except ddl.DDLShmError as exc:
            self._refused = True
            _log.warning("[ddl] DDP's buckets stay in private memory (staged): %s", exc)
            return None
        if heap is None:
            return None
        block = torch.from_numpy(heap)
        # the collective's tensor has a storage of its own: block's is swapped by the move
        target = torch.from_numpy(heap).view(t.dtype).view(t.shape)
        reduce = _planned(lambda: plan_allreduce(target, op, None, True, None), target, op,
                          name, None)

        def move_then_reduce() -> torch.Tensor:
            with torch.no_grad():
                block.copy_(t.detach().view(-1).view(torch.uint8))
            # every view of t's storage now sees the heap; block's storage takes the
            # private memory, released with it after this job
            t.untyped_storage()._swap_data_ptr_(block.untyped_storage())
            with self._lock:
                self.moved += 1
            reduce()
            return t

        return dispatch(move_then_reduce, name, True)
