"""Training throughput, two tools.

``ddl-perf train`` (``train()`` below): images or tokens per second of a standard model
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

``python -m ddl.perf.train`` (``main()`` below) is the older side-by-side comparison of
one MLP under DDP on gloo, DDP on ddl, the DistributedOptimizer and Horovod (the tables in
docs/performance.md)::

    python -m ddl.perf.train --ranks 2 --steps 20 --rounds 3 [--json out.json]
    python -m ddl.perf.train ... --horovod /path/to/horovod-venv   # + Horovod itself

It trains the same model side by side, in one job, with

- ``ddp-gloo``: DistributedDataParallel over torch's gloo,
- ``ddp-ddl``:  DistributedDataParallel over the ``ddl`` backend,
- ``ddp-ddl-view``: the same with ``gradient_as_bucket_view=True``,
- ``hvd-ddl``:  ddl.torch's DistributedOptimizer (Horovod-style hooks + fusion buffers),

plus ``compute`` (the same step with no communication), ``ddp-nocomm`` and
``ddp-view-nocomm`` (DDP in either bucket mode with a comm hook that communicates nothing:
DDP's own copies into and out of its buckets, which every backend pays; each DDP row's
``comm`` column is its step minus this), and the communication alone: one
raw allreduce of all gradient bytes on gloo and on ddl (plain tensor and ``ddl.malloc``
buffer) vs the DistributedOptimizer's whole gradient exchange (``synchronize()``: every
bucket, with its control step, launched and waited for).

The exchange is measured for both ways gradients come to it: fresh tensors each step
(``zero_grad()``, torch's default ``set_to_none=True``) and kept ones
(``zero_grad(set_to_none=False)``, accumulated into the fusion buffers). Its like-for-like
reference, ``raw-ddl-fresh``, is one raw allreduce with the optimizer's op (Average) of a
tensor made just before, as fresh gradients are; ``raw-ddl`` reuses one tensor, which
partly stays in the last-level cache.

With ``--horovod VENV`` (a virtualenv with Horovod built for this torch, e.g. by
benchmarks/build_horovod.sh), a second job started by that venv's ``horovodrun --gloo``
trains the same model with ``horovod.torch.DistributedOptimizer`` right after the first;
it reports its own compute-only step too, so the two jobs can be compared.

Modes are interleaved round by round so a noisy machine hurts them alike; figures are
medians over all timed steps. Run on CPU tensors (OMP_NUM_THREADS=1 per rank).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .models import MODELS, ModelSpec
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

# ============================================================ ddl-perf train: throughput
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
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")

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


# ------------------------------------------------------------------------ your data
def image_library() -> str | None:
    """The image decoder ``--data`` uses for JPEG/PNG (PIL), or None when not importable."""
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        return None
    return "PIL"


def scan_data(root: str | os.PathLike, spec: ModelSpec) -> tuple[list[tuple[Path, int]], str]:
    """The samples under ``root`` as (file, class index) and what they are, in words.

    Images: ``root/CLASS/*.jpg|jpeg|png`` (torchvision's ImageFolder layout; files at the
    top count as one class), decoded with PIL. ``.npy``: one image per file (HxWxC or
    CxHxW, uint8 0-255 or float) for resnet50, 1-D integer token arrays for gpt2 (cut in
    windows of seq_len + 1). Classes are the sorted sub-folder names."""
    root = Path(root)
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and p.suffix.lower() in (*IMAGE_SUFFIXES, ".npy"))
    npy = [p for p in files if p.suffix == ".npy"]
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if npy and images:
        raise ValueError(f"--data {root}: both .npy files ({len(npy)}) and images "
                         f"({len(images)}); keep one kind")
    if not files:
        raise ValueError(f"--data {root}: no .jpg, .jpeg, .png or .npy file under it")
    if images and spec.name != "resnet50":
        raise ValueError(f"--data {root}: images need --model resnet50 ({spec.name} "
                         "reads .npy token arrays)")
    if images and image_library() is None:
        raise ValueError(f"--data {root}: reading JPEG/PNG needs PIL (pip install pillow); "
                         "without it, give .npy arrays")
    classes = sorted({p.parent.relative_to(root).as_posix() for p in files})
    index = {c: i for i, c in enumerate(classes)}
    if spec.name == "resnet50" and len(classes) > spec.classes:
        raise ValueError(f"--data {root}: {len(classes)} classes, the model has "
                         f"{spec.classes} outputs")
    samples = [(p, index[p.parent.relative_to(root).as_posix()]) for p in files]
    kind = (f"{len(images)} images (JPEG/PNG, decoded with PIL)" if images
            else f"{len(npy)} .npy files")
    return samples, f"{kind} in {len(classes)} class(es) under {root}"


class ImageData:
    """Images or .npy image arrays -> (3 x S x S float32 tensor in [0, 1], class)."""

    def __init__(self, samples: Sequence[tuple[Path, int]], size: int) -> None:
        self.samples, self.size = list(samples), size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import numpy as np
        import torch

        path, label = self.samples[i]
        if path.suffix == ".npy":
            arr = np.load(path)
            if arr.ndim == 2:
                arr = arr[None]
            if arr.ndim != 3:
                raise ValueError(f"{path}: shape {arr.shape}, want HxWxC or CxHxW")
            if arr.shape[-1] in (1, 3, 4) and arr.shape[0] not in (1, 3, 4):
                arr = arr.transpose(2, 0, 1)
            x = torch.from_numpy(np.ascontiguousarray(arr[:3])).float()
            if arr.dtype == np.uint8:
                x = x / 255.0
        else:
            from PIL import Image

            with Image.open(path) as im:
                rgb = im.convert("RGB").resize((self.size, self.size))
                x = torch.from_numpy(np.asarray(rgb).transpose(2, 0, 1).copy()).float() / 255
        if x.shape[0] == 1:
            x = x.expand(3, -1, -1)
        if tuple(x.shape[1:]) != (self.size, self.size):
            x = torch.nn.functional.interpolate(x[None], size=(self.size, self.size),
                                                mode="bilinear", align_corners=False)[0]
        return x, label


class TokenData:
    """1-D integer .npy token arrays -> windows of seq_len + 1 (inputs, shifted targets)."""

    def __init__(self, samples: Sequence[tuple[Path, int]], seq_len: int, vocab: int) -> None:
        import numpy as np

        self.seq_len, self.vocab = seq_len, vocab
        self.windows: list[tuple[Path, int]] = []
        for path, _ in samples:
            arr = np.load(path, mmap_mode="r")
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(f"{path}: {arr.dtype} array of shape {arr.shape}; gpt2 "
                                 "reads 1-D integer token arrays")
            self.windows += [(path, s) for s in range(0, len(arr) - seq_len, seq_len)]
        if not self.windows:
            raise ValueError(f"no .npy file holds {seq_len + 1} tokens (--seq-len {seq_len})")

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        import numpy as np
        import torch

        path, start = self.windows[i]
        w = np.array(np.load(path, mmap_mode="r")[start:start + self.seq_len + 1],
                       dtype=np.int64)
        if w.max() >= self.vocab or w.min() < 0:
            raise ValueError(f"{path}: token {int(w.max())} outside the vocabulary "
                             f"(--vocab {self.vocab})")
        t = torch.from_numpy(w)
        return t[:-1], t[1:]


def _batches(cfg: TrainConfig, rank: int, size: int) -> tuple[Iterator[Any], str]:
    """Endless (input, target) CPU batches of this rank's share of ``--data``."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    samples, what = scan_data(cfg.data, cfg.model)
    data = (ImageData(samples, cfg.model.image_size) if cfg.model.name == "resnet50"
            else TokenData(samples, cfg.model.seq_len, cfg.model.vocab))
    sampler = DistributedSampler(data, num_replicas=size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=cfg.batch, sampler=sampler, drop_last=False,
                        num_workers=cfg.num_workers, persistent_workers=cfg.num_workers > 0,
                        pin_memory=torch.cuda.is_available())

    def forever() -> Iterator[Any]:
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    return forever(), (f"{what}; {len(data)} samples, a DataLoader with "
                       f"{cfg.num_workers} worker(s) per rank")


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
            batches, desc = _batches(cfg, rank, size)
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


# ======================================== python -m ddl.perf.train: side by side (older)

MODES = ("compute", "ddp-nocomm", "ddp-gloo", "ddp-ddl", "ddp-view-nocomm", "ddp-ddl-view",
         "hvd-ddl")
# DDP's own work per step (its gradient copies into and out of its buckets) is measured by
# the same DDP with a comm hook that communicates nothing; each DDP row's baseline:
DDP_OWN = {"ddp-gloo": "ddp-nocomm", "ddp-ddl": "ddp-nocomm", "ddp-ddl-view": "ddp-view-nocomm",
           "ddp-nocomm": "ddp-nocomm", "ddp-view-nocomm": "ddp-view-nocomm"}
COMM = ("raw-gloo", "raw-ddl", "raw-ddl-malloc", "raw-ddl-fresh", "hvd-exchange",
        "hvd-exchange-kept")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ddl.perf.train", description=__doc__)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=2048, help="hidden width of the MLP")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    ap.add_argument("--comm-reps", type=int, default=10)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--horovod", metavar="VENV",
                    help="also run Horovod's DistributedOptimizer from this virtualenv")
    ap.add_argument("--horovod-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


# ------------------------------------------------------------------- worker side
def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddl
    import ddl.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    dist.init_process_group("ddl", init_method="env://")
    gloo = dist.new_group(backend="gloo")
    rank, size = hvd.rank(), hvd.size()
    nets = {m: _model(args.width) for m in MODES}
    params = sum(p.numel() for p in nets["compute"].parameters())
    runs: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    runs["compute"] = (nets["compute"], torch.optim.SGD(nets["compute"].parameters(), lr=0.01))
    for m, pg in (("ddp-gloo", gloo), ("ddp-ddl", None), ("ddp-nocomm", None),
                  ("ddp-ddl-view", None), ("ddp-view-nocomm", None)):
        d = DDP(nets[m], process_group=pg, gradient_as_bucket_view="view" in m)
        if m.endswith("nocomm"):
            d.register_comm_hook(None, _no_communication)
        runs[m] = (d, torch.optim.SGD(d.parameters(), lr=0.01))
    runs["hvd-ddl"] = (nets["hvd-ddl"], hvd.DistributedOptimizer(
        torch.optim.SGD(nets["hvd-ddl"].parameters(), lr=0.01),
        named_parameters=nets["hvd-ddl"].named_parameters()))
    step = _stepper(runs, rank, args.batch)

    def timed(fn: Callable[[], object], reps: int,
              setup: Callable[[], object] | None = None) -> list[float]:
        out = []
        for _ in range(reps):
            if setup is not None:
                setup()
            hvd.barrier()
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out

    times: dict[str, list[float]] = {m: [] for m in MODES}
    comm: dict[str, list[float]] = {k: [] for k in COMM}
    nbytes = params * 4
    flat = torch.ones(params)
    heap = torch.from_numpy(ddl.malloc((params,), "float32"))
    heap.fill_(1.0)
    hnet, hopt = runs["hvd-ddl"]
    fresh = [flat]

    def fresh_flat() -> None:
        # as fresh gradients are: made just before, not reused from the last call
        fresh[0] = fresh[0].clone()

    for _ in range(args.rounds):
        for m in MODES:
            hvd.barrier()
            for _ in range(args.warmup):
                step(m)
            times[m] += [step(m) for _ in range(args.steps)]
        comm["raw-gloo"] += timed(lambda: dist.all_reduce(flat, group=gloo), args.comm_reps)
        comm["raw-ddl"] += timed(lambda: ddl.allreduce_(flat, ddl.Sum), args.comm_reps)
        comm["raw-ddl-malloc"] += timed(lambda: ddl.allreduce_(heap, ddl.Sum), args.comm_reps)
        comm["raw-ddl-fresh"] += timed(lambda: ddl.allreduce_(fresh[0], ddl.Average),
                                       args.comm_reps, fresh_flat)

        def fresh_grads() -> None:
            # as after a backward that followed zero_grad(set_to_none=True): every
            # gradient in memory of its own, made just now
            for p in hnet.parameters():
                p.grad = p.grad.clone()

        # no hook fires here: synchronize() launches and waits for every bucket
        comm["hvd-exchange"] += timed(hopt.synchronize, args.comm_reps, fresh_grads)
        comm["hvd-exchange-kept"] += timed(hopt.synchronize, args.comm_reps)
    final = {m: torch.cat([p.detach().reshape(-1) for p in nets[m].parameters()])
             for m in ("ddp-gloo", "ddp-ddl", "ddp-ddl-view")}
    same = all(bool(torch.allclose(final["ddp-gloo"], final[m], atol=1e-5))
               for m in ("ddp-ddl", "ddp-ddl-view"))
    med = {k: statistics.median(v) for k, v in {**times, **comm}.items()}
    # the slowest rank sets the pace: report the max over ranks of each median
    keys = sorted(med)
    worst = hvd.allreduce(torch.tensor([med[k] for k in keys], dtype=torch.float64),
                          op=hvd.Max)
    from ddl.torch.backend import _shared

    moved = int(hvd.allreduce(torch.tensor([_shared.moved]), op=hvd.Min))
    if rank == 0:
        print(json.dumps({"ranks": size, "params": params, "bytes": nbytes,
                          "buckets": len(hopt.buckets), "ddp_ddl_equals_gloo": same,
                          "ddp_buckets_in_heap": moved,
                          "median_s": dict(zip(keys, worst.tolist()))}), flush=True)
    dist.destroy_process_group()
    return 0


def _no_communication(state, bucket):  # unannotated: DDP checks a hook's annotations
    """A DDP comm hook that communicates nothing: what is left of a DDP step is DDP's own
    work (copying gradients into its buckets and back)."""
    import torch

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _model(width: int):
    import torch

    torch.manual_seed(0)
    w = width
    return torch.nn.Sequential(
        torch.nn.Linear(1024, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
        torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 10))


def _stepper(runs: dict, rank: int, batch: int) -> Callable[[str], float]:
    """One timed training step of mode ``m`` on this rank's fixed synthetic batch."""
    import torch

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 1024, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def step(m: str) -> float:
        net, opt = runs[m]
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        return time.perf_counter() - t

    return step


def _horovod_worker(args: argparse.Namespace) -> int:
    """The same model and steps under Horovod itself (launched by horovodrun --gloo)."""
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    runs = {}
    for m in ("compute", "horovod"):
        net = _model(args.width)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        if m == "horovod":
            opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
        runs[m] = (net, opt)
    step = _stepper(runs, hvd.rank(), args.batch)
    params = sum(p.numel() for p in runs["compute"][0].parameters())
    flat = torch.ones(params)
    times: dict[str, list[float]] = {"compute": [], "horovod": [], "raw-horovod": []}
    for _ in range(args.rounds):
        for m in ("compute", "horovod"):
            hvd.allreduce(torch.zeros(1), name="sync")
            for _ in range(args.warmup):
                step(m)
            times[m] += [step(m) for _ in range(args.steps)]
        for _ in range(args.comm_reps):
            hvd.allreduce(torch.zeros(1), name="sync")
            t = time.perf_counter()
            hvd.allreduce_(flat, op=hvd.Sum, name="raw")
            times["raw-horovod"].append(time.perf_counter() - t)
    keys = sorted(times)
    worst = hvd.allreduce(torch.tensor([statistics.median(times[k]) for k in keys],
                                       dtype=torch.float64), op=hvd.Max, name="medians")
    if hvd.rank() == 0:
        print(json.dumps({"horovod_version": __import__("horovod").__version__,
                          "median_s": dict(zip(keys, worst.tolist()))}), flush=True)
    return 0


def _run_horovod(args: argparse.Namespace, forward: list[str]) -> dict:
    import subprocess

    venv = os.path.abspath(args.horovod)
    horovodrun = os.path.join(venv, "bin", "horovodrun")
    if not os.path.exists(horovodrun):
        raise SystemExit(f"--horovod {venv}: no bin/horovodrun there")
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([os.path.join(venv, "bin"), os.environ.get("PATH", "")]))
    argv = [horovodrun, "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo",
            os.path.join(venv, "bin", "python"), "-m", "ddl.perf.train", "--horovod-worker",
            *forward]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln.split("]<stdout>:", 1)[-1] for ln in proc.stdout.splitlines()]
    found = [ln for ln in lines if ln.startswith("{")]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"horovod job failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"{proc.stderr[-3000:]}")
    return json.loads(found[-1])


# ------------------------------------------------------------------- parent side
def format_table(res: dict) -> str:
    m = res["median_s"]
    mb = res["bytes"] / 1e6
    lines = [
        f"# python -m ddl.perf.train (side by side): {res['params'] / 1e6:.1f} M parameters "
        f"(float32, {mb:.1f} MB of gradients), {res['ranks']} ranks, CPU; medians in ms "
        "(max over ranks)",
        "# exposed: step - compute; of which DDP's own: its bucket copies (the same DDP "
        "with a comm hook that communicates nothing); comm: the rest",
        f"# {'mode':<15} {'step ms':>8} {'exposed ms':>11} {'DDP own ms':>11} {'comm ms':>8} "
        f"{'vs ddp-gloo':>12}",
    ]
    for mode in MODES:
        if mode not in m:  # a result written before these modes existed
            continue
        cells = ["", "", ""]
        if mode != "compute":
            own = DDP_OWN.get(mode)
            own = own if own in m else None
            cells[0] = f"{1e3 * (m[mode] - m['compute']):.1f}"
            if own is not None:
                cells[1] = f"{1e3 * (m[own] - m['compute']):.1f}"
            if not mode.endswith("nocomm") and (own or not mode.startswith("ddp")):
                cells[2] = f"{1e3 * (m[mode] - m[own or 'compute']):.1f}"
        lines.append(f"  {mode:<15} {1e3 * m[mode]:8.1f} {cells[0]:>11} {cells[1]:>11} "
                     f"{cells[2]:>8} {m[mode] / m['ddp-gloo']:11.2f}x")
    lines.append(f"# {'communication only':<28} {'ms':>8} {'GB/s algbw':>11} "
                 f"{'vs raw-ddl':>11} {'vs raw-ddl-fresh':>17}")
    for k in COMM:
        lines.append(f"  {k:<28} {1e3 * m[k]:8.1f} {res['bytes'] / m[k] / 1e9:11.2f} "
                     f"{m[k] / m['raw-ddl']:10.2f}x {m[k] / m['raw-ddl-fresh']:16.2f}x")
    if "horovod" in res:
        h = res["horovod"]["median_s"]
        lines.append(f"# Horovod {res['horovod']['horovod_version']} (its own job, right after; "
                     f"its compute-only step: {1e3 * h['compute']:.1f} ms)")
        exposed = f"{1e3 * (h['horovod'] - h['compute']):.1f}"
        lines.append(f"  {'horovod':<15} {1e3 * h['horovod']:8.1f} {exposed:>11} {'':>11} "
                     f"{exposed:>8} {h['horovod'] / m['ddp-gloo']:11.2f}x")
        lines.append(f"  {'raw-horovod (allreduce only)':<28} {1e3 * h['raw-horovod']:8.1f} "
                     f"{res['bytes'] / h['raw-horovod'] / 1e9:11.2f} "
                     f"{h['raw-horovod'] / m['raw-ddl']:10.2f}x")
    if "ddp_buckets_in_heap" in res:
        lines.append(f"# DDP buckets moved into ddl's shared heap (fewest on a rank): "
                     f"{res['ddp_buckets_in_heap']} (DDL_TORCH_SHARE_BYTES, docs/pytorch.md)")
    lines.append(f"# DistributedOptimizer: {res['buckets']} fusion bucket(s); "
                 f"DDP on ddl (both bucket modes) equals DDP on gloo: "
                 f"{res['ddp_ddl_equals_gloo']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.horovod_worker:
        return _horovod_worker(args)
    from .spawn import run_job

    forward = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds",
               str(args.rounds), "--width", str(args.width), "--batch", str(args.batch),
               "--comm-reps", str(args.comm_reps)]
    job = run_job(args.ranks, ["-m", "ddl.perf.train", "--worker", *forward],
                  env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                  timeout=args.timeout, fail_fast=True)
    results = job.ranks
    bad = [r for r in results if r.returncode != 0]
    if bad:
        for r in bad:
            print(f"--- rank {r.rank} exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-4000:]}",
                  file=sys.stderr)
        return job.code or 1
    line = [ln for ln in results[0].stdout.splitlines() if ln.startswith("{")][-1]
    res = json.loads(line)
    if args.horovod:
        res["horovod"] = _run_horovod(args, forward)
    print(f"# python -m ddl.perf.train {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
