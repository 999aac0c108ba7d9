"""Training that survives a failure under ``ddlrun --max-restarts`` (torchrun's restarts):

    ddlrun -n 2 --max-restarts 3 python examples/elastic_restart.py CKPT_DIR [--crash-at 5]

When a rank fails, ddlrun stops every rank and starts the whole job again, a new job with
``TORCHELASTIC_RESTART_COUNT`` one higher. The job then goes on from its last checkpoint:
rank 0 writes one after every step (atomically: a temporary file, then a rename), and every
rank of a new start reads it. With ``--crash-at S`` rank 1 raises at step S of the first
start only, to show the restart. The model is a least-squares fit of ``w`` to ``y = 3 x``
with the gradient averaged by ``ddl.allreduce``; at the end rank 0 prints the steps each
start ran and ``w`` (close to 3).
"""

import argparse
import json
import os

import numpy as np

import ddl

STEPS = 40


def load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"step": 0, "w": 0.0, "starts": []}


def save(path: str, state: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("--crash-at", type=int, default=None)
    args = parser.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = os.path.join(args.ckpt_dir, "checkpoint.json")
    ddl.init()
    try:
        rank = ddl.rank()
        state = load(path)
        state["starts"].append([restart, state["step"]])
        rng = np.random.default_rng(rank)
        w = np.array([state["w"]])
        for step in range(state["step"], STEPS):
            if restart == 0 and rank == 1 and step == args.crash_at:
                raise RuntimeError(f"rank 1 crashes at step {step} (--crash-at)")
            x = rng.normal(size=64)
            grad = np.array([np.mean(2 * (w[0] * x - 3 * x) * x)])
            grad = ddl.allreduce(grad)  # the average over ranks
            w = w - 0.1 * grad
            ddl.barrier()  # every rank has this step's w before rank 0 records it
            if rank == 0:
                save(path, {"step": step + 1, "w": float(w[0]), "starts": state["starts"]})
        if rank == 0:
            print(json.dumps({"starts": state["starts"], "w": round(float(w[0]), 4),
                              "restart": restart}), flush=True)
        return 0
    finally:
        ddl.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
