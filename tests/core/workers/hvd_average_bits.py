"""Horovod-level Average, bit for bit Horovod's formula, on N ranks (3: not a power of
two). Horovod sums and then multiplies once by ``postscale / size``
(horovod/common/operations.cc: Average becomes Sum with ``postscale_factor /= size``;
ScaleBuffer then multiplies float16/bfloat16 elements in float32 by the factor as a float32
and rounds back once, float32 by the factor as a float32, float64 by the double). The sum is
the engine's, in rank order: float16/float32/float64 in their own dtype, rounded at every
step; bfloat16 accumulated in float32 and rounded once (ddl's engine); a reducescatter's
block starts with its own rank's terms. Checked for
allreduce, grouped_allreduce, reducescatter (single and grouped) and the
DistributedOptimizer's bucket allreduce (``submit_allreduce``), numpy arrays (the
TensorFlow path) and torch tensors, with and without prescale/postscale. Prints one JSON
report: every check's count of elements whose bits differ."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import torch

import ddl
from ddl.hvd import collectives as C
from ddl.hvd import lifecycle

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16,
          "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
         "float64": torch.float64}
SCALES = [(1.0, 1.0), (1.0, 1.5), (0.7, 1.0), (0.3, 2.5)]
ROWS, COLS = 6, 50


def data(rank: int, dt: np.dtype, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    return (rng.standard_normal((ROWS, COLS)) * 4).astype(np.float32).astype(dt)


def scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """Horovod's ScaleBuffer (CPU)."""
    if x.dtype.itemsize == 2:
        return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)
    if x.dtype == np.float32:
        return x * np.float32(factor)
    return x * np.float64(factor)


def horovod_average(xs: list[np.ndarray], pre: float, post: float) -> np.ndarray:
    xs = [scaled(x, pre) if pre != 1.0 else x for x in xs]
    if xs[0].dtype == BF16:
        acc = xs[0].astype(np.float32)
        for x in xs[1:]:
            acc = acc + x.astype(np.float32)
        total = acc.astype(BF16)
    else:
        total = xs[0].copy()
        for x in xs[1:]:
            total = total + x
    return scaled(total, post / len(xs))


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype.itemsize == 2 else
                                        np.uint32 if a.dtype.itemsize == 4 else np.uint64)


def differ(got, want: np.ndarray) -> int:
    if isinstance(got, torch.Tensor):
        got = got.float().numpy().astype(want.dtype) if got.dtype == torch.bfloat16 \
            else got.numpy()
    assert got.shape == want.shape, (got.shape, want.shape)
    return int((bits(got) != bits(want)).sum())


def as_torch(x: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(x.astype(np.float32)).to(TORCH[name]) if name == "bfloat16" \
        else torch.from_numpy(x.copy())


def main() -> dict:
    lifecycle.init()
    n, me = ddl.size(), ddl.rank()
    out: dict = {"n": n}
    lo = [sum(ROWS // n + (r < ROWS % n) for r in range(k)) for k in range(n + 1)]
    block = slice(lo[me], lo[me + 1])
    for name, dt in DTYPES.items():
        for pre, post in SCALES:
            tag = f"{name}_pre{pre}_post{post}"
            xs = [data(r, dt) for r in range(n)]
            ys = [data(r, dt, 7)[:, :3] for r in range(n)]
            want, want_y = horovod_average(xs, pre, post), horovod_average(ys, pre, post)
            # the engine reduces this rank's block of a reducescatter starting with its own
            # terms, then the others' in rank order
            order = [me] + [r for r in range(n) if r != me]
            rs_want = horovod_average([xs[r] for r in order], pre, post)[block]
            rs_want_y = horovod_average([ys[r] for r in order], pre, post)[block]
            kw = dict(op=ddl.Average, prescale=pre, postscale=post)
            for fw in ("numpy", "torch"):
                mine = xs[me] if fw == "numpy" else as_torch(xs[me], name)
                mine_y = ys[me] if fw == "numpy" else as_torch(ys[me], name)
                out[f"{fw}_allreduce_{tag}"] = differ(C.allreduce(mine, **kw), want)
                inplace = mine.copy() if fw == "numpy" else mine.clone()
                C.allreduce(inplace, inplace=True, **kw)
                out[f"{fw}_allreduce_inplace_{tag}"] = differ(inplace, want)
                g = C.grouped_allreduce([mine, mine_y], **kw)
                out[f"{fw}_grouped_{tag}"] = differ(g[0], want) + differ(g[1], want_y)
                rs = C.reducescatter([mine], **kw)
                out[f"{fw}_reducescatter_{tag}"] = differ(rs, rs_want)
                grs = C.reducescatter([mine, mine_y], grouped=True, **kw)
                out[f"{fw}_grouped_reducescatter_{tag}"] = (
                    differ(grs[0], rs_want) + differ(grs[1], rs_want_y))
        # the DistributedOptimizer's bucket allreduce: op Average, no scales of its own
        want = horovod_average([data(r, dt) for r in range(n)], 1.0, 1.0)
        t = as_torch(data(me, dt), name)
        got = C.submit_allreduce(t.reshape(-1), ddl.Average, name="bucket", async_=False)
        out[f"torch_bucket_{name}"] = differ(got.reshape(ROWS, COLS), want)
        srcs = [as_torch(data(me, dt), name) for _ in range(2)]
        buf = torch.empty(2 * ROWS * COLS, dtype=TORCH[name])
        C.submit_allreduce(buf, ddl.Average, name="into", async_=False, inplace=True,
                           sources=srcs)
        out[f"torch_bucket_sources_{name}"] = sum(differ(s, want) for s in srcs)
    # the check can tell: the engine's own Average (ddl before: divide the sum by size,
    # for bfloat16 in float32 before its one rounding), then postscale, differs from
    # Horovod's in float16 with a postscale, bfloat16 and float32
    diffs = []
    for name, post in (("float16", 1.5), ("bfloat16", 1.0), ("float32", 1.0)):
        xs = [data(r, DTYPES[name]) for r in range(n)]
        if name == "bfloat16":
            acc = sum((x.astype(np.float32) for x in xs[1:]), xs[0].astype(np.float32))
            old = (acc / np.float32(n)).astype(BF16)
        else:
            total = xs[0].copy()
            for x in xs[1:]:
                total = total + x
            old = np.divide(total, n, out=total, casting="unsafe")
        old = scaled(old, post) if post != 1.0 else old
        diffs.append(int((bits(old) != bits(horovod_average(xs, 1.0, post))).sum()))
    out["old_formula_differs"] = min(diffs)
    lifecycle.shutdown()
    return out


print(json.dumps(main()), flush=True)
