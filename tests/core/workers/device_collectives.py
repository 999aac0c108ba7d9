"""Every collective on torch tensors through the device engine (DDL_DEVICE_ENGINE=gloo on
CPU tensors, or nccl on CUDA ones), checked against numpy; prints a digest of every result
so the test can compare ranks bitwise.

argv: device ("cpu" or "cuda"), comma-separated sizes.
"""

import hashlib
import json
import sys

import numpy as np
import torch

import ddl

ddl.init()
R, N = ddl.rank(), ddl.size()
dev = torch.device(sys.argv[1] if sys.argv[1] == "cpu" else f"cuda:{ddl.local_rank()}")
sizes = [int(s) for s in sys.argv[2].split(",")]
digest = hashlib.sha256()
failed = []


def data(rank: int, n: int, dt: torch.dtype, kind: str) -> np.ndarray:
    i = np.arange(n)
    if dt == torch.bool:
        return (rank + i) % 3 == 0
    if kind == "product":
        v = ((rank + i) % 3) - 1
    else:
        v = (rank + 1) * ((i % 7) - 3)
    if dt in (torch.uint8,):
        v = np.abs(v)
    if dt.is_complex:
        return (v + 1j * (rank - i % 3)).astype(np.complex64 if dt == torch.complex64
                                                 else np.complex128)
    return v


def as_torch(a: np.ndarray, dt: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a)).to(dt).to(dev)


def check(key: str, got: torch.Tensor, want: np.ndarray, dt: torch.dtype,
          same: bool = True) -> None:
    """Compare with numpy; results every rank must share go into the digest."""
    g = got.detach().to("cpu")
    if same and g.numel():
        digest.update(key.encode())
        digest.update(g.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    w = as_torch(want, dt).to("cpu")
    if g.shape != w.shape or g.dtype != w.dtype:
        failed.append(f"{key}: got {g.dtype}{tuple(g.shape)} want {w.dtype}{tuple(w.shape)}")
        return
    if dt.is_floating_point or dt.is_complex:
        ok = torch.allclose(g.to(torch.complex128 if dt.is_complex else torch.float64),
                            w.to(torch.complex128 if dt.is_complex else torch.float64),
                            rtol=1e-2 if dt in (torch.float16, torch.bfloat16) else 1e-6)
    else:
        ok = torch.equal(g, w)
    if not ok:
        failed.append(key)


REDUCE = {ddl.Sum: lambda xs: np.sum(xs, axis=0), ddl.Min: lambda xs: np.min(xs, axis=0),
          ddl.Max: lambda xs: np.max(xs, axis=0), ddl.Product: lambda xs: np.prod(xs, axis=0)}
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool, torch.complex64)
for dt in DTYPES:
    ops = [ddl.Sum, ddl.Average] if dt.is_complex else (
        [ddl.Sum, ddl.Average, ddl.Min, ddl.Max, ddl.Product] if dt.is_floating_point
        else [ddl.Sum, ddl.Min, ddl.Max, ddl.Product])
    for op in ops:
        kind = "product" if op is ddl.Product else "plain"
        for n in sizes:
            xs = [data(r, n, dt, kind) for r in range(N)]
            if dt == torch.bool:
                want = {ddl.Sum: np.any, ddl.Max: np.any, ddl.Min: np.all,
                        ddl.Product: np.all}[op](np.stack(xs), axis=0)
            elif op is ddl.Average:
                want = np.sum(np.stack(xs).astype(np.complex128 if dt.is_complex
                                                  else np.float64), axis=0) / N
            else:
                want = REDUCE[op](np.stack(xs).astype(np.complex128 if dt.is_complex
                                                      else np.int64 if not dt.is_floating_point
                                                      else np.float64))
            x = as_torch(xs[R], dt)
            key = f"{dt}-{op.name}-{n}"
            check(key, ddl.allreduce(x, op=op), want, dt)
            y = x.clone()
            h = ddl.allreduce_async_(y, op=op)
            check(key + "-inplace-async", ddl.synchronize(h), want, dt)
            if not torch.equal(y, ddl.allreduce(x, op=op)):
                failed.append(key + "-inplace-same")

# a non-contiguous view reduced in place writes back into its base, and nothing else changes
base = (torch.arange(24, dtype=torch.float32).reshape(4, 6) * (R + 1)).to(dev)
ddl.allreduce_(base[:, 1::2], op=ddl.Sum)
tri = N * (N + 1) // 2
ref = torch.arange(24.).reshape(4, 6)
check("view", base[:, 1::2], (ref[:, 1::2] * tri).numpy(), torch.float32)
check("view-rest", base[:, ::2], (ref[:, ::2] * (R + 1)).numpy(), torch.float32, same=False)
out = torch.empty(3, 5, device=dev)
got = ddl.allreduce(torch.full((3, 5), float(R), device=dev), op=ddl.Max, out=out)
check("out", out, np.full((3, 5), N - 1.0), torch.float32)
if got is not out:
    failed.append("out-identity")

# allgather with different first dimensions, every dtype that moves
for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
    for rows in (0, 1, 5):
        mine = [data(r, (rows + r) * 3, dt, "plain").reshape(rows + r, 3) for r in range(N)]
        check(f"gather-{dt}-{rows}", ddl.allgather(as_torch(mine[R], dt)),
              np.concatenate(mine), dt)

# broadcast from every root, in place and not
for root in range(N):
    for dt in (torch.float64, torch.int8, torch.bool, torch.complex64):
        x = as_torch(data(R, 1001, dt, "plain"), dt)
        check(f"bcast-{dt}-{root}", ddl.broadcast(x, root_rank=root), data(root, 1001, dt,
                                                                           "plain"), dt)
        ddl.broadcast_(x, root_rank=root)
        check(f"bcast_-{dt}-{root}", x, data(root, 1001, dt, "plain"), dt)

# reduce_scatter: rows split as evenly as possible, lower ranks first (equal and unequal)
for rows in (2 * N, 2 * N + 1):
    for op in (ddl.Sum, ddl.Average, ddl.Max):
        xs = [data(r, rows * 3, torch.float32, "plain").reshape(rows, 3) for r in range(N)]
        full = np.sum(np.stack(xs), axis=0) if op is not ddl.Max else np.max(np.stack(xs), 0)
        if op is ddl.Average:
            full = full / N
        split = ddl.split_rows(rows, N)
        o = sum(split[:R])
        check(f"rs-{op.name}-{rows}", ddl.reduce_scatter(as_torch(xs[R], torch.float32), op=op),
              full[o : o + split[R]], torch.float32, same=False)

print(json.dumps({"rank": R, "failed": failed, "digest": digest.hexdigest(),
                  "device": ddl.api.session().devices.describe()}))
ddl.shutdown()
