"""What one elastic commit costs on one rank, next to the checkpoint a restart-style job
writes instead::

    python benchmarks/elastic_commit.py [--layers 6] [--width 2048] [--mbytes 100] [--repeats 5]

Cases (each timed ``--repeats`` times; one JSON line on stdout with every sample, seconds):

- ``torchstate``: ``hvd.elastic.TorchState(model, optimizer).commit()`` for ``--layers``
  ``nn.Linear(width, width)`` (6 x 2048: 25.2 M parameters) and Adam after one step (its two
  moments: the commit copies three times the parameters to host memory);
- ``torch-ckpt``: ``torch.save`` of the same model and optimizer state dicts to a temporary
  file then ``os.replace`` (what a torchrun-style script does per commit);
- ``objectstate``: ``ObjectState(params=<--mbytes MB float32 array>).commit()``: Horovod's
  ``ObjectState`` keeps a reference to each value, no copy;
- ``numpy-ckpt``: ``np.save`` of that array to a temporary file then ``os.replace``.

Checkpoints go to a fresh temporary directory (removed at the end; the page cache makes
them memory-speed writes unless the disk is slow).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--mbytes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """``repeats`` wall-clock samples of ``fn()``, in seconds."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def atomic(path: str, write: Callable[[str], object]) -> None:
    """``write(tmp)`` then rename over ``path``: a reader sees the old file or the new one."""
    tmp = f"{path}.tmp"
    write(tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    import ddl.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width)
                                  for _ in range(args.layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(8, args.width)).square().mean().backward()
    optimizer.step()  # Adam's moments exist from the first step on
    params = sum(p.numel() for p in model.parameters())
    torch_state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    array = np.ones(args.mbytes * (1 << 20) // 4, np.float32)
    object_state = hvd.elastic.ObjectState(params=array)
    folder = tempfile.mkdtemp(prefix="elastic_commit.")
    torch_file, numpy_file = os.path.join(folder, "model.pt"), os.path.join(folder, "a.npy")

    def torch_ckpt() -> None:
        atomic(torch_file, lambda tmp: torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp))

    def numpy_ckpt() -> None:
        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                np.save(f, array)
        atomic(numpy_file, write)

    try:
        result = {
            "params": params, "array_bytes": array.nbytes,
            "torchstate": timed(torch_state.commit, args.repeats),
            "torch-ckpt": timed(torch_ckpt, args.repeats),
            "objectstate": timed(object_state.commit, args.repeats),
            "numpy-ckpt": timed(numpy_ckpt, args.repeats),
        }
    finally:
        shutil.rmtree(folder)
        hvd.shutdown()
    result["medians"] = {name: statistics.median(result[name])
                         for name in ("torchstate", "torch-ckpt", "objectstate", "numpy-ckpt")}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
