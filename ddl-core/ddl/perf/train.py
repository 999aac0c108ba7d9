"""``ddl-perf train``: images or tokens per second of a standard model
(``models.py``: ResNet-50, a GPT-2-shaped transformer) on synthetic data or the user's own
(``--data DIR``), through ddl or a peer, on every rank of a job or alone::

    ddlrun -n 4 ddl-perf train --model resnet50 --batch 32 --via optimizer --precision amp
    ddl-perf train --model gpt2 --layers 2 --width 256 --seq-len 128 --via ddp
    ddlrun -n 2 ddl-perf train --model resnet50 --data ~/imagenet-sample --num-workers 4

``--via``: ``optimizer`` (ddl.torch.DistributedOptimizer), ``ddp`` (DistributedDataParallel
on the ``ddl`` backend), ``ddp-gloo``, ``ddp-nccl`` (torch's own backends), ``horovod``
(Horovod's own DistributedOptimizer, in a job started by Horovod's ``horovodrun``, e.g.
``VENV/bin/horovodrun -np 2 VENV/bin/python -m ddl.perf.cli train --via horovod``, or by
``ddl-perf scale --via horovod --horovod VENV``). With
``--framework keras`` (``train_keras.py``: Keras 3 on TensorFlow, synthetic data):
``optimizer`` (ddl.keras.DistributedOptimizer), ``mwms`` (MultiWorkerMirroredStrategy),
``alone`` (no communication); the shares are measured the same way. Every rank
times each step and its parts; rank 0 prints one row per rank and the job's total, and
``--json`` writes the same as a document ``ddl-perf scale`` and ``ddl-perf plot`` read.

How each share of a step is measured (``HOW``, printed with the table):

- step: wall time of one training step, from asking for the batch to the optimizer's
  update done (CUDA synchronized), median over the timed steps;
- input: the part of it spent getting the batch (the DataLoader's ``next()``) and copying
  it to the device; synthetic data is one batch made once, so this is ~0;
- compute: the same step on the same model with the gradient exchange switched off
  (``DDP.no_sync()``, ``DistributedOptimizer.skip_synchronize()``), input excluded, timed
  in rounds interleaved with the real steps so both see the same machine;
- exposed communication: step - input - compute (communication hidden behind backward
  costs nothing here); with ``--via optimizer`` also the wait itself, the time in
  ``synchronize()`` after backward.

Your own data (``--data DIR``) is read by ``train_data.py``. The older side-by-side
comparison of DDP and the DistributedOptimizer on one MLP, once ``python -m
ddl.perf.train``, is benchmarks/train_side_by_side.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from .models import MODELS, ModelSpec
from .train_data import batches as data_batches
from .train_result import (  # noqa: F401  (re-exported: ``train.summarize`` and co)
    HOW,
    VIAS,
    RankTimes,
    TrainConfig,
    format_result,
    shares,
    summarize,
    write_json,
)
from .train_result import measure as _measure

# the vias that wrap the optimizer Horovod's way (synchronize / skip_synchronize)
OPTIMIZER_VIAS = ("optimizer", "horovod")
FRAMEWORKS = {"torch": "PyTorch (models.py)", "keras": "Keras 3 on TensorFlow (train_keras.py)"}
ALL_VIAS = (*VIAS, "mwms", "alone")  # the last two: --framework keras only
DDP_BACKEND = {"ddp": "ddl", "ddp-gloo": "gloo", "ddp-nccl": "nccl"}
PRECISIONS = {
    "fp32": "float32 weights and math",
    "bf16": "bfloat16 weights, activations and gradients",
    "amp": "float32 weights, bfloat16 autocast (torch.autocast) for the math",
}

# The flags of `ddl-perf train`, one table: the parser is built from it and `ddl-perf
# scale` rebuilds a train command line from it (dest, flag, argparse keywords).
TRAIN_FLAGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("framework", "--framework", dict(default="torch", choices=tuple(FRAMEWORKS),
                                      help="torch, or keras (Keras 3 on TensorFlow; "
                                           "synthetic data; --via optimizer, mwms, alone)")),
    ("model", "--model", dict(default="resnet50", choices=MODELS,
                              help="resnet50 (images/s) or gpt2 (tokens/s)")),
    ("batch", "--batch", dict(type=int, help="samples per rank per step (resnet50: 32, "
                                             "gpt2: 8)")),
    ("precision", "--precision", dict(default="fp32", choices=tuple(PRECISIONS),
                                      help="fp32, bf16 (all bfloat16), amp (autocast "
                                           "bfloat16 over float32 weights)")),
    ("via", "--via", dict(default="optimizer", choices=ALL_VIAS,
                          help="optimizer: ddl's DistributedOptimizer; torch: ddp (DDP on "
                               "the ddl backend), ddp-gloo, ddp-nccl (DDP on torch's "
                               "backends), horovod (Horovod's own, under horovodrun); "
                               "keras: mwms (MultiWorkerMirroredStrategy), alone (no "
                               "communication)")),
    ("device", "--device", dict(default="auto", choices=("auto", "cpu", "cuda"),
                                help="auto: this rank's GPU (LOCAL_RANK) when CUDA is there")),
    ("steps", "--steps", dict(type=int, default=20, help="timed steps per round (20)")),
    ("warmup", "--warmup", dict(type=int, default=3,
                                help="untimed steps before each round's timed ones (3)")),
    ("rounds", "--rounds", dict(type=int, default=2,
                                help="rounds of timed steps, then as many compute-only "
                                     "ones (2)")),
    ("data", "--data", dict(metavar="DIR", help="your data instead of synthetic: an image "
                                                "folder (CLASS/*.jpg|png) or .npy files")),
    ("num_workers", "--num-workers", dict(type=int, default=2,
                                          help="DataLoader worker processes with --data (2)")),
    ("width", "--width", dict(type=int, help="resnet50: stem width (64); gpt2: model "
                                             "width (768)")),
    ("layers", "--layers", dict(type=int, default=12, help="gpt2: blocks (12)")),
    ("heads", "--heads", dict(type=int, default=12, help="gpt2: attention heads (12)")),
    ("seq_len", "--seq-len", dict(type=int, default=1024, help="gpt2: tokens per sample "
                                                               "(1024)")),
    ("vocab", "--vocab", dict(type=int, default=50257, help="gpt2: vocabulary (50257)")),
    ("image_size", "--image-size", dict(type=int, default=224,
                                        help="resnet50: image side in pixels (224)")),
)


def add_train_arguments(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    for dest, flag, kw in TRAIN_FLAGS:
        p.add_argument(flag, dest=dest, **kw)
    if json_flag:
        p.add_argument("--json", metavar="PATH", help="also write the result as JSON")


def train_argv(args: argparse.Namespace) -> list[str]:
    """The ``ddl-perf train`` flags of ``args`` that differ from their defaults (argv)."""
    argv = []
    for dest, flag, kw in TRAIN_FLAGS:
        value = getattr(args, dest)
        if value is not None and value != kw.get("default"):
            argv += [flag, str(value)]
    return argv


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The typed config, every check on the user's flags done here (ValueError)."""
    spec = ModelSpec(name=args.model, width=args.width, layers=args.layers, heads=args.heads,
                     seq_len=args.seq_len, vocab=args.vocab, image_size=args.image_size)
    spec.validate()
    batch = args.batch if args.batch is not None else (32 if args.model == "resnet50" else 8)
    for flag, value, low in (("--batch", batch, 1), ("--steps", args.steps, 1),
                             ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1),
                             ("--num-workers", args.num_workers, 0)):
        if value < low:
            raise ValueError(f"{flag} {value}: must be >= {low}")
    framework = getattr(args, "framework", "torch")
    if framework == "keras":
        from . import train_keras

        train_keras.check(spec, args.via, args.data)
    elif args.via not in VIAS:
        raise ValueError(f"--via {args.via} is a Keras exchange: add --framework keras, or "
                         f"choose one of {', '.join(VIAS)}")
    if args.via == "ddp-nccl" and args.device == "cpu":
        raise ValueError("--via ddp-nccl needs CUDA tensors: drop --device cpu")
    if args.data is not None and not os.path.isdir(args.data):
        raise ValueError(f"--data {args.data}: not a directory")
    return TrainConfig(model=spec, batch=batch, precision=args.precision, via=args.via,
                       device=args.device, steps=args.steps, warmup=args.warmup,
                       rounds=args.rounds, data=args.data, num_workers=args.num_workers,
                       json_path=getattr(args, "json", None), framework=framework)


# ----------------------------------------------------------------- measuring (ranks)
def _alone_rendezvous() -> None:
    """One rank of our own: torch's process groups still want an address (this process)."""
    from ddlrun.preflight import pick_free_pair

    from .. import topology

    if "WORLD_SIZE" not in os.environ and topology.world_from_env().size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(pick_free_pair()))


def _device(cfg: TrainConfig, local_rank: int) -> Any:
    import torch

    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here")
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    if cfg.via == "ddp-nccl":
        raise ValueError("--via ddp-nccl needs CUDA: torch sees no CUDA device here")
    return torch.device("cpu")


class _Trainer:
    """The model, its optimizer and its exchange on this rank; ``step`` and ``compute``
    time one step with and without the exchange."""

    def __init__(self, cfg: TrainConfig, hvd: Any, dev: Any) -> None:
        import torch

        from . import models

        self.cfg, self.dev = cfg, dev
        net = models.build(cfg.model).to(dev)
        if cfg.precision == "bf16":
            net = net.to(torch.bfloat16)
        self.params = models.count_params(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        self.plain: tuple[Any, Any] | None = None
        if cfg.via == "horovod":
            # Horovod's hooks fire on every backward and cannot be switched off (its
            # skip_synchronize skips only step's wait): compute-only steps run on a copy
            import copy

            twin = copy.deepcopy(net)
            self.plain = (twin, torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9))
        if cfg.via in OPTIMIZER_VIAS:
            hvd.broadcast_parameters(net.state_dict(), root_rank=0)
            opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None)
        self.net, self.opt = net, opt
        self.cuda = dev.type == "cuda"

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.dev)

    def to_device(self, x: Any, y: Any) -> tuple[Any, Any]:
        import torch

        x = x.to(self.dev, non_blocking=True)
        if self.cfg.precision == "bf16" and x.is_floating_point():
            x = x.to(torch.bfloat16)
        return x, y.to(self.dev, non_blocking=True)

    def _forward_backward(self, x: Any, y: Any, net: Any = None, opt: Any = None) -> None:
        import contextlib

        import torch

        from . import models

        amp = (torch.autocast(self.dev.type, dtype=torch.bfloat16)
               if self.cfg.precision == "amp" else contextlib.nullcontext())
        (opt or self.opt).zero_grad()
        with amp:
            out = (net or self.net)(x)
        models.loss(self.cfg.model, out, y).backward()

    def step(self, batches: Iterator[Any]) -> tuple[float, float, float | None, Any]:
        """(step, input, wait or None, the device batch) of one real training step."""
        self._sync()
        t0 = time.perf_counter()
        x, y = self.to_device(*next(batches))
        self._sync()
        t1 = time.perf_counter()
        self._forward_backward(x, y)
        wait = None
        if self.cfg.via in OPTIMIZER_VIAS:
            self._sync()
            t2 = time.perf_counter()
            self.opt.synchronize()
            self._sync()
            wait = time.perf_counter() - t2
            with self.opt.skip_synchronize():
                self.opt.step()
        else:
            self.opt.step()
        self._sync()
        return time.perf_counter() - t0, t1 - t0, wait, (x, y)

    def compute(self, x: Any, y: Any) -> float:
        """The same step on a batch already on the device, the exchange switched off."""
        self._sync()
        t0 = time.perf_counter()
        if self.plain is not None:
            net, opt = self.plain
            self._forward_backward(x, y, net, opt)
            opt.step()
        elif self.cfg.via in OPTIMIZER_VIAS:
            with self.opt.skip_synchronize():
                self._forward_backward(x, y)
                self.opt.step()
        else:
            with self.net.no_sync():
                self._forward_backward(x, y)
            self.opt.step()
        self._sync()
        return time.perf_counter() - t0


def _ddl_torch() -> Any:
    _alone_rendezvous()
    import ddl.torch

    return ddl.torch


def _launched_size() -> int:
    """How many ranks the launcher started (horovodrun, mpirun or ddlrun), 1 alone."""
    for var in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def _horovod() -> Any:
    """Horovod itself, for --via horovod: the same loop, its DistributedOptimizer."""
    from .ddlrun_job import horovod_can_join

    if _launched_size() > 1 and not horovod_can_join(os.environ):
        raise ValueError("--via horovod: this job was not started by horovodrun (or mpirun), "
                         "so Horovod cannot find its peers: start it with horovodrun, or "
                         "`ddl-perf scale --via horovod --horovod VENV`")
    try:
        import horovod.torch
    except ImportError as exc:
        raise ValueError(f"--via horovod: horovod.torch does not import here ({exc}); run "
                         "this under a Horovod virtualenv's horovodrun, or `ddl-perf scale "
                         "--via horovod --horovod VENV`") from None
    return horovod.torch


def train(cfg: TrainConfig) -> int:
    """``ddl-perf train`` on every rank of the job (or alone); rank 0 prints."""
    if cfg.framework == "keras":
        from .train_keras import train_keras

        return train_keras(cfg)
    import torch
    import torch.distributed as dist

    from . import models

    hvd = _horovod() if cfg.via == "horovod" else _ddl_torch()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if cfg.via == "horovod" and size != _launched_size():
        raise ValueError(f"--via horovod: Horovod sees {size} rank(s) where the launcher "
                         f"started {_launched_size()}: start Horovod jobs with its "
                         "horovodrun (or ddl-perf scale --via horovod)")
    if not os.environ.get("OMP_NUM_THREADS"):  # a core left for ddl's progress threads
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size() - 1))
    dev = _device(cfg, hvd.local_rank())
    if cfg.via in DDP_BACKEND:
        dist.init_process_group(DDP_BACKEND[cfg.via], init_method="env://", rank=rank,
                                world_size=size)
    try:
        trainer = _Trainer(cfg, hvd, dev)
        if cfg.data is None:
            batch = trainer.to_device(*models.synthetic_batch(cfg.model, cfg.batch, rank))
            batches: Iterator[Any] = iter(lambda: batch, None)
            desc = "synthetic (one batch made once per rank, on the device: input time is ~0)"
        else:
            batches, desc = data_batches(cfg, rank, size)
        mine = dataclasses.replace(_measure(cfg, trainer, batches, hvd.barrier), rank=rank)
        times = sorted(hvd.allgather_object(mine), key=lambda t: t.rank)
        if rank == 0:
            where = f"{dev}, {torch.get_num_threads()} torch thread(s) per rank"
            doc = summarize(cfg, times, trainer.params, desc, where)
            print(format_result(doc), flush=True)
            write_json(cfg, doc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def train_main(args: argparse.Namespace) -> int:
    """``ddl-perf train``: the flags checked, then the measurement; 2 on a bad request."""
    from .. import DDLError

    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"ddl-perf train: {exc}", file=sys.stderr)
        return 2
    try:
        return train(cfg)
    except (ValueError, DDLError) as exc:
        print(f"ddl-perf train: {exc}", file=sys.stderr)
        return 2
