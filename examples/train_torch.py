"""Data-parallel training of a small CNN with PyTorch on ddl.

Every rank trains on its own shard of a synthetic 10-class image problem (3x32x32 images:
a fixed pattern per class plus noise). Two ways, same model, same numbers:

    ddlrun -n 2 python examples/train_torch.py                # Horovod-style DistributedOptimizer
    ddlrun -n 2 python examples/train_torch.py --mode ddp     # DDP on the "ddl" backend

Rank 0 prints ``step i/n loss x`` lines (examples/demo.py turns them into a progress bar),
the held-out accuracy and samples/s; ``--json`` writes the figures for the demo.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddl.torch as hvd

CLASSES = 10


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    patterns = torch.randn(CLASSES, 3, 32, 32, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return patterns[y] * 0.5 + torch.randn(n, 3, 32, 32, generator=g), y


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 8 * 8, 128)
        self.fc2 = torch.nn.Linear(128, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["hvd", "ddp"], default="hvd")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=64, help="per-rank batch")
    ap.add_argument("--lr", type=float, default=0.02, help="per-rank lr (scaled by ranks)")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    ap.add_argument("--fp16", action="store_true", help="Compression.fp16 (hvd mode)")
    ap.add_argument("--json", help="write the figures here (rank 0)")
    args = ap.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = CNN()
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size,
                                                 momentum=0.9)
    if args.mode == "ddp":
        dist.init_process_group("ddl", init_method="env://")
        # the gradients become views of DDP's buckets (which ddl keeps in shared memory):
        # no copy of every gradient out of them after each step
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=True)
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if args.fp16 else hvd.Compression.none)
        net = model
    x_all, y_all = make_data(args.steps * args.batch, seed=100 + rank)  # this rank's shard
    report = max(1, args.steps // 30)
    t0 = time.perf_counter()
    for step in range(args.steps):
        if step == args.warmup:
            t0 = time.perf_counter()
        x = x_all[step * args.batch:(step + 1) * args.batch]
        y = y_all[step * args.batch:(step + 1) * args.batch]
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and (step % report == 0 or step == args.steps - 1):
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - t0
    timed = args.steps - min(args.warmup, args.steps - 1)
    rate = size * args.batch * timed / elapsed

    xt, yt = make_data(2000, seed=7)
    with torch.no_grad():
        accuracy = float((model(xt).argmax(1) == yt).float().mean())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    identical = bool(all(torch.equal(f, flat) for f in hvd.allgather(flat.reshape(1, -1))))
    figures = {"ranks": size, "mode": args.mode, "samples_per_s": rate,
               "per_rank": rate / size, "accuracy": accuracy, "identical": identical,
               "params": flat.numel()}
    if rank == 0:
        print(f"{size} rank(s), {args.mode}: {rate:,.0f} samples/s, accuracy {accuracy:.3f}, "
              f"ranks identical: {identical}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f)
    if args.mode == "ddp":
        dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
