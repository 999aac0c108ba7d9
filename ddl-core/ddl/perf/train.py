"""ddl-perf train: the same model trained side by side, in one job, with

- ``ddp-gloo``: DistributedDataParallel over torch's gloo,
- ``ddp-ddl``:  DistributedDataParallel over the ``ddl`` backend,
- ``hvd-ddl``:  ddl.torch's DistributedOptimizer (Horovod-style hooks + fusion buffers),

plus ``compute`` (the same step with no communication), and the communication alone: one
raw allreduce of all gradient bytes on gloo and on ddl (plain tensor and ``ddl.malloc``
buffer) vs the DistributedOptimizer's whole gradient exchange (pack, allreduce, unpack).

    python -m ddl.perf.train --ranks 2 --steps 20 --rounds 3 [--json out.json]

Modes are interleaved round by round so a noisy machine hurts them alike; figures are
medians over all timed steps. Run on CPU tensors (OMP_NUM_THREADS=1 per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

MODES = ("compute", "ddp-gloo", "ddp-ddl", "hvd-ddl")


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
    w = args.width

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(1024, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
            torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 10))

    nets = {m: model() for m in MODES}
    params = sum(p.numel() for p in nets["compute"].parameters())
    runs: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    runs["compute"] = (nets["compute"], torch.optim.SGD(nets["compute"].parameters(), lr=0.01))
    for m, pg in (("ddp-gloo", gloo), ("ddp-ddl", None)):
        d = DDP(nets[m], process_group=pg)
        runs[m] = (d, torch.optim.SGD(d.parameters(), lr=0.01))
    runs["hvd-ddl"] = (nets["hvd-ddl"], hvd.DistributedOptimizer(
        torch.optim.SGD(nets["hvd-ddl"].parameters(), lr=0.01),
        named_parameters=nets["hvd-ddl"].named_parameters()))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1024, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def step(m: str) -> float:
        net, opt = runs[m]
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        return time.perf_counter() - t

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
    comm: dict[str, list[float]] = {k: [] for k in
                                    ("raw-gloo", "raw-ddl", "raw-ddl-malloc", "hvd-exchange")}
    nbytes = params * 4
    flat = torch.ones(params)
    heap = torch.from_numpy(ddl.malloc((params,), "float32"))
    heap.fill_(1.0)
    hnet, hopt = runs["hvd-ddl"]
    for _ in range(args.rounds):
        for m in MODES:
            hvd.barrier()
            for _ in range(args.warmup):
                step(m)
            times[m] += [step(m) for _ in range(args.steps)]
        comm["raw-gloo"] += timed(lambda: dist.all_reduce(flat, group=gloo), args.comm_reps)
        comm["raw-ddl"] += timed(lambda: ddl.allreduce_(flat, ddl.Sum), args.comm_reps)
        comm["raw-ddl-malloc"] += timed(lambda: ddl.allreduce_(heap, ddl.Sum), args.comm_reps)

        def fresh_grads() -> None:
            # as after a backward with zero_grad(set_to_none=True): gradients in their own
            # memory, so the timed exchange includes packing them into the fusion buffers
            for p in hnet.parameters():
                p.grad = p.grad.clone()

        # no hook fires here: synchronize() packs, allreduces and unpacks every bucket
        comm["hvd-exchange"] += timed(hopt.synchronize, args.comm_reps, fresh_grads)
    final = {m: torch.cat([p.detach().reshape(-1) for p in nets[m].parameters()])
             for m in ("ddp-gloo", "ddp-ddl")}
    same = bool(torch.allclose(final["ddp-gloo"], final["ddp-ddl"], atol=1e-5))
    med = {k: statistics.median(v) for k, v in {**times, **comm}.items()}
    # the slowest rank sets the pace: report the max over ranks of each median
    keys = sorted(med)
    worst = hvd.allreduce(torch.tensor([med[k] for k in keys], dtype=torch.float64),
                          op=hvd.Max)
    if rank == 0:
        print(json.dumps({"ranks": size, "params": params, "bytes": nbytes,
                          "buckets": len(hopt.buckets), "ddp_ddl_equals_gloo": same,
                          "median_s": dict(zip(keys, worst.tolist()))}), flush=True)
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------- parent side
def format_table(res: dict) -> str:
    m = res["median_s"]
    mb = res["bytes"] / 1e6
    lines = [
        f"# ddl-perf train: {res['params'] / 1e6:.1f} M parameters (float32, {mb:.1f} MB of "
        f"gradients), {res['ranks']} ranks, CPU; medians in ms (max over ranks)",
        f"# {'mode':<10} {'step ms':>9} {'exposed comm ms':>16} {'vs ddp-gloo':>12}",
    ]
    for mode in MODES:
        exposed = m[mode] - m["compute"]
        lines.append(f"  {mode:<10} {1e3 * m[mode]:9.1f} "
                     f"{'' if mode == 'compute' else f'{1e3 * exposed:.1f}':>16} "
                     f"{m[mode] / m['ddp-gloo']:11.2f}x")
    lines.append(f"# {'communication only':<28} {'ms':>8} {'GB/s algbw':>11} "
                 f"{'vs raw-ddl':>11}")
    for k in ("raw-gloo", "raw-ddl", "raw-ddl-malloc", "hvd-exchange"):
        lines.append(f"  {k:<28} {1e3 * m[k]:8.1f} {res['bytes'] / m[k] / 1e9:11.2f} "
                     f"{m[k] / m['raw-ddl']:10.2f}x")
    lines.append(f"# DistributedOptimizer: {res['buckets']} fusion bucket(s); "
                 f"DDP on ddl equals DDP on gloo: {res['ddp_ddl_equals_gloo']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    from .spawn import run_local

    forward = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds",
               str(args.rounds), "--width", str(args.width), "--batch", str(args.batch),
               "--comm-reps", str(args.comm_reps)]
    results = run_local(args.ranks, ["-m", "ddl.perf.train", "--worker", *forward],
                        env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                        timeout=args.timeout)
    bad = [r for r in results if r.returncode != 0]
    if bad:
        for r in bad:
            print(f"--- rank {r.rank} exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-4000:]}",
                  file=sys.stderr)
        return 1
    line = [ln for ln in results[0].stdout.splitlines() if ln.startswith("{")][-1]
    res = json.loads(line)
    print(f"# python -m ddl.perf.train {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
