"""Data-parallel training of a small MLP with ddl, in plain numpy.

Every rank trains on its own shard of a synthetic 10-class problem; gradients are averaged
with one fused ``ddl.allreduce_`` per step (all layers in one buffer from ``ddl.malloc``),
so every rank keeps identical weights. Run it through the launcher:

    ddlrun -n 2 python examples/train_numpy.py --steps 200

Rank 0 prints the loss, the accuracy on held-out data and samples/s; ``--json`` writes the
figures for examples/demo.py.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import ddl


def make_data(n: int, dim: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(1234).standard_normal((classes, dim)) * 0.35
    y = rng.integers(0, classes, n)
    x = centers[y] + rng.standard_normal((n, dim)) * 1.5
    return x.astype(np.float32), y


def _views(buf: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    offs = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    return [buf[a:b].reshape(s) for a, b, s in zip(offs[:-1], offs[1:], shapes)]


class MLP:
    """All parameters live in one flat buffer and all gradients in a twin, both from
    ddl.malloc, so one allreduce per step moves every gradient without staging copies."""

    def __init__(self, dim: int, hidden: int, classes: int):
        shapes = [(dim, hidden), (hidden,), (hidden, classes), (classes,)]
        n = sum(int(np.prod(s)) for s in shapes)
        self.flat = ddl.malloc((n,), np.float32)
        self.grad = ddl.malloc((n,), np.float32)
        self.flat[:] = 0
        self.p = _views(self.flat, shapes)
        self.g = _views(self.grad, shapes)
        rng = np.random.default_rng(0)  # same seed everywhere; broadcast makes sure anyway
        self.p[0][...] = rng.standard_normal(shapes[0]) * np.sqrt(2 / dim)
        self.p[2][...] = rng.standard_normal(shapes[2]) * np.sqrt(2 / hidden)

    def loss_and_grad(self, x: np.ndarray, y: np.ndarray) -> float:
        w1, b1, w2, b2 = self.p
        h = np.maximum(x @ w1 + b1, 0)
        logits = h @ w2 + b2
        logits -= logits.max(axis=1, keepdims=True)
        prob = np.exp(logits)
        prob /= prob.sum(axis=1, keepdims=True)
        loss = -np.log(prob[np.arange(len(y)), y] + 1e-12).mean()
        d = prob
        d[np.arange(len(y)), y] -= 1
        d /= len(y)
        self.g[3][...] = d.sum(0)
        self.g[2][...] = h.T @ d
        dh = (d @ w2.T) * (h > 0)
        self.g[1][...] = dh.sum(0)
        self.g[0][...] = x.T @ dh
        return float(loss)

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        w1, b1, w2, b2 = self.p
        return float(((np.maximum(x @ w1 + b1, 0) @ w2 + b2).argmax(1) == y).mean())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256, help="per-rank batch")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--json", help="rank 0 writes its figures here")
    a = ap.parse_args()

    ddl.init()
    rank, size = ddl.rank(), ddl.size()
    classes = 10
    model = MLP(a.dim, a.hidden, classes)
    ddl.broadcast_(model.flat, root_rank=0)

    x, y = make_data(a.batch * 64, a.dim, classes, seed=100 + rank)  # this rank's shard
    xt, yt = make_data(4000, a.dim, classes, seed=99)
    comm = 0.0
    losses = []
    ddl.barrier()
    t0 = time.perf_counter()
    for step in range(a.steps):
        i = (step * a.batch) % (len(x) - a.batch)
        losses.append(model.loss_and_grad(x[i : i + a.batch], y[i : i + a.batch]))
        tc = time.perf_counter()
        ddl.allreduce_(model.grad, op=ddl.Average)
        comm += time.perf_counter() - tc
        model.flat -= a.lr * model.grad
        if rank == 0 and (step + 1) % max(1, a.steps // 5) == 0:
            print(f"step {step + 1:4d}/{a.steps}  loss {np.mean(losses[-20:]):.3f}", flush=True)
    ddl.barrier()
    elapsed = time.perf_counter() - t0
    # Every rank must hold the very same weights: check with a max/min allreduce.
    same = np.array_equal(ddl.allreduce(model.flat, op=ddl.Max),
                          ddl.allreduce(model.flat, op=ddl.Min))
    acc = model.accuracy(xt, yt)
    rate = a.steps * a.batch * size / elapsed
    if rank == 0:
        print(f"ranks {size}: {rate:,.0f} samples/s total ({rate / size:,.0f} per rank), "
              f"held-out accuracy {acc:.3f}, communication {100 * comm / elapsed:.1f}% of time, "
              f"weights identical on all ranks: {same}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"ranks": size, "samples_per_s": rate, "accuracy": acc,
                           "comm_fraction": comm / elapsed, "identical": bool(same)}, f)
    ddl.shutdown()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
