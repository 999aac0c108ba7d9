"""The training script ``elastic_recovery.py`` times: the same steps in both recovery styles,
so the two differ only in how a lost worker is survived::

    ddlrun -np 3 --min-np 2 --max-np 3 python elastic_worker.py inplace STAMPS [options]
    ddlrun -n 3 --max-restarts 1      python elastic_worker.py restart STAMPS --ckpt DIR ...

Each step computes a "gradient" of the model, averages it over the ranks with one
allreduce and applies it. ``--model numpy``: the model is one float32 vector of
``--params`` elements; ``--model torch``: an MLP of about ``--params`` parameters trained by
``ddl.torch``'s ``DistributedOptimizer`` (SGD with momentum) on random batches.

- ``inplace`` (Horovod's style): the state is an ``ObjectState`` / ``TorchState`` committed
  every ``--commit`` steps in host memory; ``@elastic.run`` restores the last commit after
  the loss and the survivors go on in the re-formed world, in the same processes.
- ``restart`` (torchrun's style): every ``--commit`` steps rank 0 writes a checkpoint
  atomically (a temporary file, then ``os.replace``); every start loads it if there is one.

Rank ``--kill-rank`` (default 1) of the first world SIGKILLs itself right after step
``--kill-step`` (0: no loss), having stamped the time just before; with ``--kill-agent`` it
SIGKILLs its whole host instead: its parent (the host's ddlrun or torchrun agent), every
other worker that agent started, then itself (a whole host lost, as across ssh hosts).
Every rank appends one JSON line per completed step to ``STAMPS.<pid>``: ``{"t", "world",
"step", "size"}``; ``world`` counts re-formed worlds (in-place) or restarts
(``TORCHELASTIC_RESTART_COUNT``). The killed rank writes ``{"kill": t}``; every process
first writes ``{"start": t}``, the time its script began.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

STARTED = time.time()  # before the heavy imports: a restart's process start is part of its cost

import numpy as np  # noqa: E402 - after the start stamp


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("style", choices=("inplace", "restart"))
    parser.add_argument("stamps", help="prefix of the per-process stamp files")
    parser.add_argument("--model", choices=("numpy", "torch"), default="numpy")
    parser.add_argument("--params", type=int, default=1 << 20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--commit", type=int, default=3, help="commit every N steps")
    parser.add_argument("--kill-step", type=int, default=7, help="0: no worker is lost")
    parser.add_argument("--kill-rank", type=int, default=1, help="the rank that is lost")
    parser.add_argument("--kill-agent", action="store_true",
                        help="lose the rank's whole host: SIGKILL its agent (ddlrun's or "
                             "torchrun's) and every worker the agent started")
    parser.add_argument("--ckpt", help="checkpoint directory (restart style)")
    return parser


class Stamps:
    """One process's stamp file: a JSON line per completed step, flushed at once so a
    SIGKILL loses nothing already stamped."""

    def __init__(self, prefix: str) -> None:
        self.path = f"{prefix}.{os.getpid()}"

    def write(self, **fields: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def die(stamps: Stamps, agent: bool = False) -> None:
    """The loss being measured: stamp the time, then SIGKILL this process, or its whole host:
    its parent, the host's agent (ddlrun's or torchrun's), and every other worker that agent
    started (torchrun's workers, in sessions of their own, would outlive their agent)."""
    stamps.write(kill=time.time())
    if agent:
        parent = os.getppid()
        siblings = [pid for pid in children(parent) if pid != os.getpid()]
        for pid in (parent, *siblings):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.kill(os.getpid(), signal.SIGKILL)


def children(parent: int) -> list[int]:
    """The pids whose parent is ``parent`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the fourth field after the command's closing parenthesis is the ppid
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            out.append(int(entry))
    return out


def loses(args: argparse.Namespace, world: int, rank: int, step: int) -> bool:
    """Whether this rank is the one lost, right after ``step`` of the first world (or
    first run)."""
    return world == 0 and rank == args.kill_rank and step == args.kill_step


# --- the numpy model --------------------------------------------------------------------

def numpy_step(ddl: Any, params: np.ndarray) -> np.ndarray:
    """One step: a gradient that depends on the rank, averaged, applied (a new array, so a
    committed ``ObjectState`` value is never changed in place)."""
    grad = np.tanh(params) + np.float32(ddl.rank() + 1)
    grad = ddl.allreduce(grad, ddl.Average)
    return params - np.float32(1e-3) * grad



def train_steps(state: Any, args: argparse.Namespace, stamps: Stamps, world: list[int],
                step: Any) -> None:
    """The in-place loop both models run (inside ``elastic.run``): a step, its stamp, the
    loss when it is due, a commit every ``--commit`` steps."""
    import ddl

    while state.step < args.steps:
        step(state)
        state.step += 1
        stamps.write(t=time.time(), world=world[0], step=state.step, size=ddl.size())
        if loses(args, world[0], ddl.rank(), state.step):
            die(stamps, args.kill_agent)
        if state.step % args.commit == 0:
            state.commit()

def numpy_inplace(args: argparse.Namespace, stamps: Stamps) -> None:
    import ddl
    import ddl.elastic as elastic
    from ddl.hvd import lifecycle

    lifecycle.init()
    world = [0]
    state = elastic.ObjectState(step=0, params=np.zeros(args.params, np.float32))
    state.register_reset_callbacks([lambda: world.__setitem__(0, world[0] + 1)])

    def step(state: Any) -> None:
        state.params = numpy_step(ddl, state.params)

    elastic.run(train_steps)(state, args, stamps, world, step)
    lifecycle.shutdown()


def numpy_restart(args: argparse.Namespace, stamps: Stamps) -> None:
    import ddl

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = os.path.join(args.ckpt, "model.npz")
    ddl.init()
    try:
        try:
            with np.load(path) as saved:
                step, params = int(saved["step"]), saved["params"]
        except FileNotFoundError:
            step, params = 0, np.zeros(args.params, np.float32)
        while step < args.steps:
            params = numpy_step(ddl, params)
            step += 1
            stamps.write(t=time.time(), world=restart, step=step, size=ddl.size())
            if loses(args, restart, ddl.rank(), step):
                die(stamps, args.kill_agent)
            if step % args.commit == 0 and ddl.rank() == 0:
                tmp = f"{path}.tmp"
                with open(tmp, "wb") as f:
                    np.savez(f, step=step, params=params)
                os.replace(tmp, path)
    finally:
        ddl.shutdown()


# --- the torch model --------------------------------------------------------------------

def torch_model(params: int) -> tuple[Any, Any]:
    """An MLP of two square layers with about ``params`` parameters, and its optimizer."""
    import torch

    import ddl.torch as hvd

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = int((params / 2) ** 0.5)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, width))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
        named_parameters=model.named_parameters())
    return model, optimizer


def torch_step(model: Any, optimizer: Any, step: int) -> None:
    import torch

    width = model[0].in_features
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, width, generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), x).backward()
    optimizer.step()


def torch_inplace(args: argparse.Namespace, stamps: Stamps) -> None:
    import ddl.torch as hvd

    hvd.init()
    model, optimizer = torch_model(args.params)
    world = [0]
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    state.register_reset_callbacks([lambda: world.__setitem__(0, world[0] + 1)])

    def step(state: Any) -> None:
        torch_step(state.model, state.optimizer, state.step)

    hvd.elastic.run(train_steps)(state, args, stamps, world, step)
    hvd.shutdown()


def torch_restart(args: argparse.Namespace, stamps: Stamps) -> None:
    import torch

    import ddl.torch as hvd

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = os.path.join(args.ckpt, "model.pt")
    hvd.init()
    try:
        model, optimizer = torch_model(args.params)
        step = 0
        if os.path.exists(path):
            saved = torch.load(path)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            step = saved["step"]
        while step < args.steps:
            torch_step(model, optimizer, step)
            step += 1
            stamps.write(t=time.time(), world=restart, step=step, size=hvd.size())
            if loses(args, restart, hvd.rank(), step):
                die(stamps, args.kill_agent)
            if step % args.commit == 0 and hvd.rank() == 0:
                tmp = f"{path}.tmp"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step}, tmp)
                os.replace(tmp, path)
    finally:
        hvd.shutdown()


RUNS = {("numpy", "inplace"): numpy_inplace, ("numpy", "restart"): numpy_restart,
        ("torch", "inplace"): torch_inplace, ("torch", "restart"): torch_restart}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.style == "restart" and not args.ckpt:
        raise SystemExit("elastic_worker.py: the restart style needs --ckpt DIR")
    stamps = Stamps(args.stamps)
    stamps.write(start=STARTED)
    RUNS[args.model, args.style](args, stamps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
