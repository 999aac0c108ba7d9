"""DDP's gradient buckets move into ddl's shared heap, so peers reduce them in place.

A tensor in ddl's heap (``ddl.malloc``) is reduced where it lives: two synchronisations
for the whole call, no copy into the staging slots and none back. DDP's buckets are
torch's own memory, allocated once and handed to every backward's allreduce, so on the
shared-memory engine each call staged them chunk by chunk, one synchronisation per chunk:
on a loaded host each synchronisation waits for the peer's thread to be scheduled
(docs/performance.md, "DDP's buckets in the shared heap").

The backend therefore moves such a buffer into the heap when it sees it again, on the
caller's thread, just before queueing its allreduce: a heap block takes the storage's bytes
and the two storages swap their memory (``UntypedStorage._swap_data_ptr_``), so every view
of the storage (DDP's bucket views, the gradients with ``gradient_as_bucket_view``)
follows, and the private memory is released. Only buffers that cannot be seen moving are
taken:

- an allreduce issued during a backward pass (where DDP and its comm hooks run),
- a contiguous CPU tensor that spans its whole storage, of ``DDL_TORCH_SHARE_BYTES`` or
  more, whose storage this backend allreduced before and which is still that storage
  (DDP's buckets are reused; a fresh tensor each step stays where it is),
- only while nothing queued on ddl's workers can still read or write it: no collective is
  in flight but this backend's allreduces of other storages,
- while /dev/shm keeps a quarter of its size free after it.

A moved storage cannot be resized (``resize_`` raises, as for any tensor from
``torch.from_numpy``); DDP never resizes its buckets. A numpy array taken from such a tensor
earlier (``p.grad.numpy()`` with ``gradient_as_bucket_view``) keeps the old memory's address;
DDP invalidates those itself when it rebuilds its buckets after the first step, and
docs/pytorch.md says so.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import ddl

from .. import config
from ..api import in_shared_memory, jobs_in_flight, shared_block
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


class SharedBuckets:
    """Decides, per allreduce of the backend, whether its tensor moves into the heap first,
    and moves it."""

    def __init__(self) -> None:
        self.min_bytes = 0  # nothing moves until configure()
        self.moved = 0  # buffers moved so far (tests read it)
        # storages allreduced once, by StorageImpl address: the weak reference keeps the
        # address from being reused by another storage while it is remembered
        self._seen: OrderedDict[int, StorageWeakRef] = OrderedDict()
        self._inflight: dict[int, int] = {}  # this backend's allreduces queued, per storage
        self._inflight_total = 0
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

    def _seen_before(self, t: torch.Tensor) -> bool:
        """Whether this very storage was allreduced here before; remembers it if not."""
        storage = t.untyped_storage()
        with self._lock:
            ref = self._seen.get(storage._cdata)
            if ref is not None and not ref.expired():
                self._seen.move_to_end(storage._cdata)
                return True
            self._seen[storage._cdata] = StorageWeakRef(storage)
            if len(self._seen) > _REMEMBERED:
                self._seen.popitem(last=False)
            return False

    def _untouched_by_queued_work(self, t: torch.Tensor) -> bool:
        """No job queued on ddl's workers can read or write ``t``: every job in flight is an
        allreduce of this backend, and none of another storage's is of ``t``'s."""
        # Both counts only fall while we look (jobs finish; our own count falls first), and
        # ours never exceeds ddl's: read ddl's first, and equality means nothing else runs.
        queued = jobs_in_flight()
        with self._lock:
            return (self._inflight_total == queued
                    and t.untyped_storage()._cdata not in self._inflight)

    def track(self, t: torch.Tensor, handle: ddl.Handle) -> None:
        """Count the backend's allreduce of ``t`` as in flight until ``handle`` is done."""
        key = t.untyped_storage()._cdata
        with self._lock:
            self._inflight[key] = self._inflight.get(key, 0) + 1
            self._inflight_total += 1

        def done(_: ddl.Handle) -> None:
            with self._lock:
                self._inflight_total -= 1
                left = self._inflight.pop(key) - 1
                if left:
                    self._inflight[key] = left

        handle.add_done_callback(done)

    def move_if_reused(self, t: torch.Tensor) -> bool:
        """Move ``t``'s storage into the heap if it qualifies (see the module's doc), here,
        before its allreduce is queued. Returns whether it moved."""
        if not self._eligible(t) or not self._seen_before(t):
            return False
        flat = t.detach().view(-1).view(torch.uint8)
        if in_shared_memory(flat.numpy()) is not False:
            return False  # already there, or no heap on this engine
        nbytes = flat.numel()
        total, free = segments.space()
        if free - nbytes < total * KEEP_FREE:
            return False  # leave /dev/shm to DataLoader workers and the rest of the host
        if not self._untouched_by_queued_work(t):
            return False  # a later call, when nothing queued can still use its memory
        try:
            heap = shared_block(nbytes)
        except ddl.DDLShmError as exc:
            self._refused = True
            _log.warning("[ddl] DDP's buckets stay in private memory (staged): %s", exc)
            return False
        if heap is None:
            return False
        block = torch.from_numpy(heap)
        with torch.no_grad():
            block.copy_(flat)
        # every view of t's storage now sees the heap; block's storage takes the private
        # memory, released with it below
        t.untyped_storage()._swap_data_ptr_(block.untyped_storage())
        del block, flat
        with self._lock:
            self.moved += 1
            self._seen.pop(t.untyped_storage()._cdata, None)
        return True
