"""``ddl-perf train --data DIR``: the user's own samples instead of synthetic ones.

An image folder (torchvision's ImageFolder layout, ``CLASS/*.jpg|jpeg|png``, decoded with
PIL) or ``.npy`` arrays (images for resnet50, 1-D token arrays for gpt2), read by a torch
DataLoader with a DistributedSampler: each rank trains on its share, epoch after epoch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .models import ModelSpec
from .train_result import TrainConfig

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


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


def batches(cfg: TrainConfig, rank: int, size: int) -> tuple[Iterator[Any], str]:
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
