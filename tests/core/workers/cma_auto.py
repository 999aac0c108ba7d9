"""Large private buffers under DDL_SHM_CMA=auto (the default): numpy arrays (on huge pages
from the start) and torch tensors (collapsed into huge pages when reused), in place and out
of place, reused and fresh every call, every dtype, checked against numpy bit for bit.
Prints one JSON line: what failed, a digest of every result, and what the engine's policy
did (buffers offered in place, collapses)."""

import hashlib
import json

import numpy as np
import torch

import ddl
from ddl import api
from ddl.engines.hugepages import PageSizes

ddl.init()
R, N = ddl.rank(), ddl.size()
TRI = N * (N + 1) // 2
digest = hashlib.sha256()
failed = []


def check(name, got, want):
    got = got.numpy() if isinstance(got, torch.Tensor) else got
    if got.dtype != want.dtype or not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        failed.append(name)
    digest.update(np.ascontiguousarray(got).view(np.uint8).tobytes())


def values(dtype, count, rank):
    """Small integers, exact in every dtype and any order of summation."""
    v = (np.arange(count) * 7 + rank) % 5 + rank
    return v.astype(bool) if dtype == np.bool_ else v.astype(dtype)


for dtype in (np.bool_, np.int8, np.uint8, np.int16, np.int32, np.int64, np.float16,
              np.float32, np.float64, np.complex64):
    isz = np.dtype(dtype).itemsize
    count = (9 << 20) // isz + 7  # over the 8 MiB floor, odd
    want = values(dtype, count, 0)
    for r in range(1, N):
        more = values(dtype, count, r)
        want = want | more if dtype == np.bool_ else want + more
    name = np.dtype(dtype).name
    # reused: numpy's arrays sit on huge pages; torch's are collapsed on their second call
    a = np.empty(count, dtype)
    t = torch.empty(count, dtype=torch.from_numpy(a[:1]).dtype)
    for i in range(3):
        a[:] = values(dtype, count, R)
        ddl.allreduce_(a, op=ddl.Sum)
        check(f"numpy-in-place-{name}-{i}", a, want)
        t.numpy()[:] = values(dtype, count, R)
        ddl.allreduce_(t, op=ddl.Sum)
        check(f"torch-in-place-{name}-{i}", t, want)
        # out of place: a reused input, a fresh output
        check(f"numpy-out-{name}-{i}", ddl.allreduce(values(dtype, count, R), op=ddl.Sum), want)
    for i in range(3):  # fresh every call, wherever the allocator puts it
        fresh = torch.from_numpy(values(dtype, count, R)).clone()
        ddl.allreduce_(fresh, op=ddl.Sum)
        check(f"torch-fresh-{name}-{i}", fresh, want)

bf = torch.full(((9 << 20) // 2 + 3,), float(R + 1), dtype=torch.bfloat16)
for i in range(3):
    bf.fill_(R + 1)
    ddl.allreduce_(bf, op=ddl.Sum)
    if not torch.equal(bf, torch.full_like(bf, float(TRI))):
        failed.append(f"bfloat16-{i}")
    digest.update(bf.view(torch.int16).numpy().tobytes())

engine = api.session().engine
hot = getattr(engine, "hot_buffers", None)
# what this kernel does with memory like the above (the test asks for a collapse only
# where torch's memory is small and one can be made, which compaction may refuse)
pages = PageSizes()
probe = torch.ones(9 << 18)
at, size = probe.data_ptr(), probe.numel() * 4
torch_huge = pages.huge(at, size)
print(json.dumps({"rank": R, "failed": failed, "digest": digest.hexdigest(),
                  "cma": getattr(engine, "cross_memory", None),
                  "offered": hot.offered if hot else None,
                  "collapses": hot.collapses if hot else None,
                  "scannable": torch_huge is not None,
                  "torch_small": torch_huge is False,
                  "collapsible": bool(torch_huge is False and pages.collapse(at, size))}))
ddl.barrier()
ddl.shutdown()
