"""DDP on gloo, DDP on ddl, ddl.torch's DistributedOptimizer and Horovod, side by side in
one job on one MLP (the tables in docs/performance.md); what ``ddl-perf train --via`` does
not split apart: DDP's own bucket copies, DDP's ``gradient_as_bucket_view`` mode, and the
gradient exchange against one raw allreduce of the same bytes::

    python benchmarks/train_side_by_side.py --ranks 2 --steps 20 --rounds 3 [--json out.json]
    python benchmarks/train_side_by_side.py ... --horovod /path/to/horovod-venv   # + Horovod

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
medians over all timed steps. Run on CPU tensors (OMP_NUM_THREADS=1 per rank). Once
``python -m ddl.perf.train``; ``ddl-perf train`` measures the throughput of standard models.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

SCRIPT = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(SCRIPT))

MODES = ("compute", "ddp-nocomm", "ddp-gloo", "ddp-ddl", "ddp-view-nocomm", "ddp-ddl-view",
         "hvd-ddl")
# DDP's own work per step (its gradient copies into and out of its buckets) is measured by
# the same DDP with a comm hook that communicates nothing; each DDP row's baseline:
DDP_OWN = {"ddp-gloo": "ddp-nocomm", "ddp-ddl": "ddp-nocomm", "ddp-ddl-view": "ddp-view-nocomm",
           "ddp-nocomm": "ddp-nocomm", "ddp-view-nocomm": "ddp-view-nocomm"}
COMM = ("raw-gloo", "raw-ddl", "raw-ddl-malloc", "raw-ddl-fresh", "hvd-exchange",
        "hvd-exchange-kept")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python benchmarks/train_side_by_side.py",
                                 description=__doc__.split("\n\n")[0])
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
    src = os.path.join(REPO, "ddl-core")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([os.path.join(venv, "bin"), os.environ.get("PATH", "")]))
    argv = [horovodrun, "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo",
            os.path.join(venv, "bin", "python"), SCRIPT, "--horovod-worker",
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
        f"# train_side_by_side.py: {res['params'] / 1e6:.1f} M parameters "
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
    # here, not at the top: Horovod's venv runs this file as its worker without ddlrun
    from ddl.perf.spawn import run_job

    forward = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds",
               str(args.rounds), "--width", str(args.width), "--batch", str(args.batch),
               "--comm-reps", str(args.comm_reps)]
    job = run_job(args.ranks, [SCRIPT, "--worker", *forward],
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
    given = " ".join(argv if argv is not None else sys.argv[1:])
    print(f"# benchmarks/train_side_by_side.py {given}")
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
