"""Elastic PyTorch training with ddl, ported from Horovod Elastic by changing the import:
the job loses a worker, re-forms its world in place and goes on from the last commit::

    ddlrun -np 3 --min-np 2 --max-np 3 python examples/elastic_torch.py --epochs 2

A small regression network learns a fixed random linear map from synthetic data (CPU,
seconds). ``hvd.elastic.TorchState`` holds the model, the optimizer, the
``ElasticSampler`` and the epoch and batch counters; ``state.commit()`` every
``--batches-per-commit`` batches and at every epoch's end. When a worker is lost, the
survivors restore the last commit, the reset callback scales the learning rate to the new
number of ranks, and the sampler deals what is left of the epoch over the new world.
Rank 0 ends with ``FINAL epochs=E commits=C size=N sha256=<hex>``: the digest of the float32
bytes of every parameter, so two runs can be compared bit for bit.

To try a lost worker: ``--fail-worker localhost:1 --fail-at-batch 7`` makes the worker of
that name (``host:slot``, ddlrun's ``DDL_ELASTIC_WORKER``) SIGKILL itself right after
batch 7 of epoch 0; with ``--fail-host`` it SIGKILLs its host's ddlrun agent instead, and
every worker of that host dies with it, as when the host is lost.

``--save-at-commit K PATH`` and ``--load PATH`` make the reference run a test compares
with (tests/torch/test_elastic_example.py): the first run stops right after commit K and
rank 0 saves what that commit holds (model, optimizer, sampler, epoch, batch) to PATH; a
second run, with another number of ranks, loads it and goes on. That is the same change
of world at the same commit, done by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import ddl.torch as hvd

INPUTS, OUTPUTS = 8, 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batches-per-commit", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--samples", type=int, default=240, help="in the synthetic data set")
    p.add_argument("--lr", type=float, default=0.01, help="for one rank; scaled by size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-worker", metavar="HOST:SLOT",
                   help="the worker that SIGKILLs itself (with --fail-at-batch)")
    p.add_argument("--fail-host", action="store_true",
                   help="it SIGKILLs its host's ddlrun agent (the whole host is lost)")
    p.add_argument("--fail-at-batch", type=int, metavar="N",
                   help="it does so right after batch N (counted from 1) of epoch 0")
    p.add_argument("--save-at-commit", nargs=2, metavar=("K", "PATH"),
                   help="stop after commit K; rank 0 saves the state to PATH")
    p.add_argument("--load", metavar="PATH", help="start from a state saved there")
    return p


@dataclass(frozen=True)
class Plan:
    """What ``train`` needs besides the state."""

    epochs: int
    batches_per_commit: int
    batch_size: int
    fail_at: int | None  # this worker's batch to die at, if it is the one to fail
    fail_host: bool  # then it takes its host's agent (and so every worker there) with it
    save_at: int | None
    save_path: str | None


def make_data(samples: int, seed: int) -> torch.utils.data.TensorDataset:
    """``y = x @ W + noise`` with a fixed ``W``: the same data on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, INPUTS, generator=g)
    w = torch.randn(INPUTS, OUTPUTS, generator=g)
    y = x @ w + 0.1 * torch.randn(samples, OUTPUTS, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def save(state: Any, path: str) -> None:
    """What the last commit holds (the live objects equal it right after ``commit``)."""
    torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                "sampler": state.sampler.state_dict(), "epoch": state.epoch,
                "batch": state.batch}, path)


def load(state: Any, path: str) -> None:
    saved = torch.load(path, weights_only=False)
    state.model.load_state_dict(saved["model"])
    state.optimizer.load_state_dict(saved["optimizer"])
    state.sampler.load_state_dict(saved["sampler"])
    state.epoch, state.batch = saved["epoch"], saved["batch"]
    state.save()  # what a restore brings back is the loaded state


@hvd.elastic.run
def train(state: Any, loader: torch.utils.data.DataLoader, plan: Plan) -> bool:
    """Train to the last epoch from wherever the state is; False when stopped for
    ``--save-at-commit``."""
    while state.epoch < plan.epochs:
        state.model.train()
        # the loader iterates the sampler's share of what is left of this epoch, dealt over
        # the current world: after a reset it starts at the first batch of that share
        for idx, (x, y) in enumerate(loader):
            state.optimizer.zero_grad()
            F.mse_loss(state.model(x), y).backward()
            state.optimizer.step()
            state.sampler.record_batch(idx, plan.batch_size)
            state.batch += 1
            if state.epoch == 0 and state.batch == plan.fail_at:
                if plan.fail_host:  # the agent's death takes its workers down with it
                    os.kill(os.getppid(), signal.SIGKILL)
                    time.sleep(60)
                os.kill(os.getpid(), signal.SIGKILL)
            if state.batch % plan.batches_per_commit == 0:
                state.commit()
                if state.commits == plan.save_at:
                    if hvd.rank() == 0 and plan.save_path:
                        save(state, plan.save_path)
                    return False
        state.epoch += 1
        state.batch = 0
        state.sampler.set_epoch(state.epoch)  # at the end: see ElasticSampler's docstring
        state.commit()
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)  # one thread: the same float sums on every run
    hvd.init()
    torch.manual_seed(args.seed)
    data = make_data(args.samples, args.seed)
    # pad=True: every rank gets a share of the same length, so every rank runs the same
    # number of batches (each batch is an allreduce all ranks must join); without it a
    # re-shard can leave one rank a batch more, and the loop would need hvd.join()
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=args.seed, pad=True)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = torch.nn.Sequential(torch.nn.Linear(INPUTS, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, OUTPUTS))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, batch=0)

    def scale_lr() -> None:
        # the gradients are averaged over the ranks: keep lr proportional to their number
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([scale_lr])
    if args.load:
        load(state, args.load)
        scale_lr()  # as after a reset: the saved lr is the old world's

    me = os.environ.get("DDL_ELASTIC_WORKER")
    fail_at = args.fail_at_batch if args.fail_worker and args.fail_worker == me else None
    save_at = int(args.save_at_commit[0]) if args.save_at_commit else None
    plan = Plan(args.epochs, args.batches_per_commit, args.batch_size, fail_at,
                args.fail_host, save_at,
                args.save_at_commit[1] if args.save_at_commit else None)
    finished = train(state, loader, plan)
    if hvd.rank() == 0:
        if finished:
            print(f"FINAL epochs={state.epoch} commits={state.commits} size={hvd.size()} "
                  f"sha256={digest(model)}", flush=True)
        else:
            print(f"SAVED commit={state.commits} epoch={state.epoch} batch={state.batch}",
                  flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
