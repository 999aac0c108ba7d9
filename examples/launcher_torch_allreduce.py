"""A torchrun-style PyTorch (gloo) script, unchanged under ddlrun:

    ddlrun -H h1:2,h2:2 --network-interface eth0 python examples/launcher_torch_allreduce.py

Uses only the env contract (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...).
"""

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.full((256,), float(rank + 1))
    dist.all_reduce(t)
    want = size * (size + 1) / 2
    ok = bool(torch.allclose(t, torch.full_like(t, want)))
    names = [None] * size
    dist.all_gather_object(names, socket.gethostname())
    print(f"rank {rank}/{size} local {os.environ['LOCAL_RANK']} group {os.environ['GROUP_RANK']}"
          f" host {socket.gethostname()} hosts {','.join(sorted(set(names)))} "
          f"allreduce {'ok' if ok else 'WRONG'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
