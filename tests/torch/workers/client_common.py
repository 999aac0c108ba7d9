"""What the client workers (client_lightning.py, client_accelerate.py,
client_transformers.py) share: the backend from argv, a digest of the weights, the report.

Each worker runs under ``ddlrun -n 2`` with ``ddl`` or ``gloo`` as its one argument and
prints one JSON line: its rank, the backend torch.distributed ended up on, the number of
optimizer steps, the SHA-256 of every parameter's bytes (in ``state_dict`` order) and
whatever else the client logged. The test compares the lines of both ranks and of both
backends.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys

import torch
import torch.distributed as dist

import ddl.torch  # noqa: F401 - registers the "ddl" backend

BACKENDS = ("ddl", "gloo")


def backend_from_argv() -> str:
    if len(sys.argv) != 2 or sys.argv[1] not in BACKENDS:
        raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(BACKENDS)}}}")
    torch.set_num_threads(1)
    return sys.argv[1]


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's weights, bit for bit (names and dtypes included)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def report(**fields) -> None:
    """Print this rank's JSON line, then leave the process group while Python is alive."""
    fields = {"rank": dist.get_rank(), "world": dist.get_world_size(),
              "backend": dist.get_backend(), **fields}
    print(json.dumps(fields), flush=True)
    # Gloo's worker threads keep the tensors of their last collectives and drop them during
    # interpreter shutdown, which can abort (see torchrun_style.py); release them now.
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
