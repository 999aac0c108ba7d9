"""What ``ddl-perf train``'s two trainers share (``train.py`` for PyTorch,
``train_keras.py`` for Keras): each framework's exchanges (``--via``) and how a step's
shares are measured, the run's configuration, the measuring loop over a trainer
(``measure``) and the result document (``summarize``, ``format_result``, ``write_json``),
so a Keras run writes the same document as a PyTorch one.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from .models import ModelSpec

VIAS = {  # --via: how gradients are exchanged (torch; KERAS_VIAS for keras)
    "optimizer": "ddl.torch.DistributedOptimizer",
    "ddp": "DistributedDataParallel on the ddl backend",
    "ddp-gloo": "DistributedDataParallel on torch's gloo",
    "ddp-nccl": "DistributedDataParallel on torch's nccl (CUDA)",
    "horovod": "Horovod's own DistributedOptimizer (horovod.torch, under horovodrun)",
}
KERAS_VIAS = {
    "optimizer": "ddl.keras.DistributedOptimizer",
    "mwms": "tf.distribute.MultiWorkerMirroredStrategy (RING), custom loop",
    "alone": "no communication: every rank trains its own copy",
}
HOW = (
    "step = median wall time of a training step (input + forward + backward + exchange + "
    "update); input = the part spent in the DataLoader's next() and the copy to the "
    "device; compute = the same step with the exchange switched off (DDP.no_sync / "
    "DistributedOptimizer.skip_synchronize), input excluded, in interleaved rounds; "
    "comm = step - input - compute (exposed communication); wait = time in "
    "synchronize() after backward (--via optimizer only)"
)
KERAS_HOW = (
    "step = median wall time of a training step (batch taken, tf.function of forward + "
    "backward + exchange + update called, loss fetched); input = the part spent taking "
    "the batch; compute = the same step without the exchange (optimizer: a plain SGD on "
    "the same model; mwms: a twin model outside the strategy; alone: the same step), "
    "input excluded, in interleaved rounds; comm = step - input - compute (exposed "
    "communication)"
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelSpec
    batch: int
    precision: str = "fp32"
    via: str = "optimizer"
    device: str = "auto"
    steps: int = 20
    warmup: int = 3
    rounds: int = 2
    data: str | None = None
    num_workers: int = 2
    json_path: str | None = None
    framework: str = "torch"


class Trainer(Protocol):
    """One rank's model and exchange: ``step`` times a training step (step, input, wait,
    the batch), ``compute`` the same step without the exchange (``train._Trainer``,
    ``train_keras.KerasTrainer``)."""

    params: int

    def step(self, batches: Iterator[Any]) -> tuple[float, float, float | None, Any]: ...

    def compute(self, *batch: Any) -> float: ...


# ------------------------------------------------------------------- measuring (pure)
@dataclasses.dataclass(frozen=True)
class RankTimes:
    """One rank's medians in seconds (``wait`` only with --via optimizer)."""

    rank: int
    step: float
    input: float
    compute: float
    wait: float | None = None


def shares(step: float, input_s: float, compute: float) -> dict[str, float]:
    """Fractions of a step: compute, exposed comm (the rest, never below 0), input."""
    if step <= 0:
        raise ValueError(f"step time {step}: must be > 0")
    i = min(input_s / step, 1.0)
    c = min(compute / step, 1.0 - i)  # a compute-only step a little slower: no comm left
    return {"compute": c, "comm": max(0.0, 1.0 - c - i), "input": i}


def summarize(cfg: TrainConfig, times: Sequence[RankTimes], params: int,
              data_desc: str, device: str) -> dict:
    """The result document (what --json writes, and what scale and plot read)."""
    per_sample = cfg.model.units_per_sample
    rows = []
    for t in times:
        rows.append({"rank": t.rank, "step_s": t.step, "input_s": t.input,
                     "compute_s": t.compute, "wait_s": t.wait,
                     "throughput": cfg.batch * per_sample / t.step,
                     "shares": shares(t.step, t.input, t.compute)})
    mean = {k: statistics.fmean(getattr(t, k) for t in times)
            for k in ("step", "input", "compute")}
    total = sum(r["throughput"] for r in rows)
    keras = cfg.framework == "keras"
    return {
        "tool": "ddl-perf", "kind": "train", "version": 1, "framework": cfg.framework,
        "model": cfg.model.name, "model_config": dataclasses.asdict(cfg.model),
        "describe": cfg.model.describe(), "params": params, "unit": cfg.model.unit,
        "batch": cfg.batch, "units_per_sample": per_sample, "precision": cfg.precision,
        "via": cfg.via, "device": device, "ranks": len(times), "data": data_desc,
        "steps": cfg.steps, "warmup": cfg.warmup, "rounds": cfg.rounds,
        "per_rank": rows,
        "throughput": {"total": total, "per_rank": total / len(times)},
        "step_s": max(t.step for t in times),
        "shares": shares(mean["step"], mean["input"], mean["compute"]),
        "how": KERAS_HOW if keras else HOW,
    }


def write_json(cfg: TrainConfig, doc: dict) -> None:
    """The document at ``--json`` (nothing without it)."""
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


def format_result(doc: dict) -> str:
    unit = doc["unit"]
    wait = all(r["wait_s"] is not None for r in doc["per_rank"])
    framework = doc.get("framework", "torch")  # documents before Keras have none
    vias = KERAS_VIAS if framework == "keras" else VIAS
    lines = [
        f"# ddl-perf train: {doc['describe']}, {doc['params'] / 1e6:.3f} M parameters, "
        f"batch {doc['batch']} per rank, {doc['precision']}, via {doc['via']} "
        f"({vias[doc['via']]}), {doc['ranks']} rank(s) on {doc['device']}",
        f"# data: {doc['data']}",
        f"# {doc['rounds']} round(s) of {doc['warmup']} warm-up + {doc['steps']} timed steps, "
        f"then {doc['steps']} compute-only; medians",
        f"# {'rank':>4} {'step ms':>9} {unit + '/s':>12} {'compute %':>10} {'comm %':>7} "
        f"{'input %':>8}" + (f" {'wait ms':>8}" if wait else ""),
    ]
    for r in doc["per_rank"]:
        s = r["shares"]
        lines.append(f"  {r['rank']:>4} {r['step_s'] * 1e3:>9.2f} {r['throughput']:>12.1f} "
                     f"{100 * s['compute']:>10.1f} {100 * s['comm']:>7.1f} "
                     f"{100 * s['input']:>8.1f}"
                     + (f" {r['wait_s'] * 1e3:>8.2f}" if wait else ""))
    s, t = doc["shares"], doc["throughput"]
    lines += [
        f"# total {t['total']:.1f} {unit}/s over {doc['ranks']} rank(s), {t['per_rank']:.1f} "
        f"per rank; step {doc['step_s'] * 1e3:.2f} ms (slowest rank); compute "
        f"{100 * s['compute']:.1f}%, exposed comm {100 * s['comm']:.1f}%, input "
        f"{100 * s['input']:.1f}%",
        f"# how: {doc['how']}",
    ]
    return "\n".join(lines)


def measure(cfg: TrainConfig, trainer: Trainer, batches: Iterator[Any],
             barrier: Callable[[], None]) -> RankTimes:
    steps: list[float] = []
    inputs: list[float] = []
    waits: list[float] = []
    computes: list[float] = []
    batch = None
    for _ in range(cfg.rounds):
        barrier()
        for _ in range(cfg.warmup):
            trainer.step(batches)
        for _ in range(cfg.steps):
            step, input_s, wait, batch = trainer.step(batches)
            steps.append(step)
            inputs.append(input_s)
            if wait is not None:
                waits.append(wait)
        barrier()
        trainer.compute(*batch)  # untimed: the first step after the switch
        computes += [trainer.compute(*batch) for _ in range(cfg.steps)]
    med = statistics.median
    return RankTimes(rank=-1, step=med(steps), input=med(inputs), compute=med(computes),
                     wait=med(waits) if waits else None)
