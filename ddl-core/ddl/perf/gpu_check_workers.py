"""The ranks of ``ddl-perf gpu-check``'s own checks: ``python -m ddl.perf.gpu_check_workers
CHECK [--simulate-cpu] [ARGS]``, started by ddlrun (one rank per GPU, LOCAL_RANK set).

Each check runs on every rank and rank 0 prints one line, ``GPU-CHECK-RESULT {json}``
(status pass/fail/skip, summary, table, details), which the runner (``gpu_check.py``)
reads; the exit code is 1 when the check failed. An exception ends the rank, ddlrun tears
the job down, and the runner reports the check as failed with the job's last lines.

``--simulate-cpu``: the same code on CPU tensors; the caller sets DDL_DEVICE_ENGINE=gloo so
ddl's device engine takes them (per-line torch process groups over Gloo instead of NCCL),
and torch's own Gloo group stands in for its NCCL one. That is how the checks run in the
tests on machines without a GPU.

Checks: ``collectives`` (the device engine against numpy on every dtype and odd sizes,
bitwise equal on every rank), ``ddp`` (DDP on the ``ddl`` backend against DDP on nccl),
``multidim --grid AxB`` (the multi-dimensional allreduce over a DDL_OPTIONS grid),
``set_device`` (each rank on its own device) and ``tensorflow`` (ddl.tensorflow on GPU
tensors).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .gpu_check_plan import MARK

# the dtypes of the collectives check: every one ddl takes from torch (int16 has no NCCL
# reduction: ddl stages it through the host engines, in order with the rest)
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
          "int64", "bool", "complex64")
SIZES = (1, 7, 1001, 65537, 1048577)  # odd: no chunk or block boundary falls evenly
SIM_SIZES = (1, 7, 1001)
# allgather, broadcast and reduce_scatter stop here: reduce_scatter moves (2 ranks + 1) x size
# elements per rank, and every rank computes numpy's answer for all of them
MOVE_LIMIT = 65537


# ------------------------------------------------------------------------- plumbing
def emit(rank: int, status: str, summary: str, *, columns: tuple[str, ...] = (),
         rows: list[tuple[str, ...]] | None = None, details: list[str] | None = None) -> int:
    """Rank 0 prints the result line; every rank returns the exit code (1: failed)."""
    if rank == 0:
        doc = {"status": status, "summary": summary, "columns": list(columns),
               "rows": [list(r) for r in rows or []], "details": details or []}
        print(MARK + json.dumps(doc), flush=True)
    return 1 if status == "fail" else 0


class Ranks:
    """ddl started, this rank's device chosen (its GPU, by LOCAL_RANK; the CPU when
    simulating), and the job's control plane on host arrays (``perf.worker.Harness``)."""

    def __init__(self, simulate: bool) -> None:
        import torch

        from .worker import Harness

        self.torch, self.simulate = torch, simulate
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        if simulate:
            self.dev = torch.device("cpu")
        else:
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device on this rank")
            torch.cuda.set_device(self.local % torch.cuda.device_count())
            self.dev = torch.device("cuda", torch.cuda.current_device())
        self.harness = Harness()
        self.rank, self.size = self.harness.rank, self.harness.size

    def gather(self, text: str) -> list[str]:
        return self.harness.gather_lines(text)

    def close(self) -> None:
        self.harness.close()


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def _bytes(t: Any) -> bytes:
    """A tensor's bytes as they are (bfloat16 and bool included: numpy has neither)."""
    import torch

    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------- collectives
def data(rank: int, n: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s input: small integers (exact in every dtype up to 8 ranks: sums stay
    within int8 and bfloat16's exact range), unsigned where the dtype is."""
    i = np.arange(n)
    if dtype == "bool":
        return (rank + i) % 3 == 0
    v = (rank + 1) * ((i % 7) - 3)
    if dtype == "uint8":
        v = np.abs(v)
    if dtype.startswith("complex"):
        return (v + 1j * (rank - i % 3)).astype(np.complex64)
    return v


REDUCTIONS = ("sum", "min", "max")


def expected(xs: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """numpy's answer: bool reduces logically (sum = any, min = all), as ddl does."""
    stack = np.stack(xs)
    if dtype == "bool":
        return {"sum": np.any, "max": np.any, "min": np.all}[op](stack, axis=0)
    wide = stack.astype(np.complex128 if dtype.startswith("complex") else np.float64)
    return {"sum": np.sum, "min": np.min, "max": np.max}[op](wide, axis=0)


class Collectives:
    """The device engine's four collectives on one dtype, every size, against numpy."""

    def __init__(self, ranks: Ranks) -> None:
        import ddl

        self.ddl, self.r, self.torch = ddl, ranks, ranks.torch
        self.same: list[bytes] = []  # results every rank must hold byte for byte
        self.failed: list[str] = []
        self.cases = 0

    def tensor(self, values: np.ndarray, dtype: str) -> Any:
        t = self.torch.from_numpy(np.array(values, copy=True))  # never the caller's memory
        return t.to(getattr(self.torch, dtype)).to(self.r.dev)

    def compare(self, key: str, got: Any, want: np.ndarray, dtype: str, same: bool = True
                ) -> None:
        self.cases += 1
        torch = self.torch
        w = self.tensor(want, dtype).to("cpu")
        g = got.detach().to("cpu")
        if same:
            self.same.append(key.encode() + _bytes(g))
        if g.shape != w.shape or g.dtype != w.dtype:
            self.failed.append(f"{key}: got {g.dtype}{tuple(g.shape)}, want "
                               f"{w.dtype}{tuple(w.shape)}")
        elif not torch.equal(g, w):
            self.failed.append(key)

    def one_dtype(self, dtype: str, sizes: tuple[int, ...]) -> str:
        """Every collective on ``dtype``; returns the engine ddl routed it to."""
        ddl, n, rank = self.ddl, self.r.size, self.r.rank
        ops = {"sum": ddl.Sum, "min": ddl.Min, "max": ddl.Max}
        if dtype.startswith("complex"):
            ops = {"sum": ddl.Sum}  # complex numbers have no order
        for size in sizes:
            xs = [data(r, size, dtype) for r in range(n)]
            for name, op in ops.items():
                self.compare(f"allreduce-{dtype}-{name}-{size}",
                             ddl.allreduce(self.tensor(xs[rank], dtype), op=op),
                             expected(xs, name, dtype), dtype)
            if size > MOVE_LIMIT:
                continue  # the largest size is for allreduce: the others are checked below it
            # unequal contributions: rank r brings size + r elements
            parts = [data(r, size + r, dtype) for r in range(n)]
            self.compare(f"allgather-{dtype}-{size}",
                         ddl.allgather(self.tensor(parts[rank], dtype)),
                         np.concatenate(parts), dtype)
            for root in sorted({0, n - 1}):
                x = self.tensor(xs[rank], dtype)
                ddl.broadcast_(x, root_rank=root)
                self.compare(f"broadcast-{dtype}-{root}-{size}", x, xs[root], dtype)
            if dtype != "bool":
                rows = 2 * n + 1  # rows split unevenly, lower ranks first
                mats = [data(r, rows * size, dtype).reshape(rows, size) for r in range(n)]
                split = ddl.split_rows(rows, n)
                lo = sum(split[:rank])
                self.compare(f"reduce_scatter-{dtype}-{size}",
                             ddl.reduce_scatter(self.tensor(mats[rank], dtype), op=ddl.Sum),
                             expected(mats, "sum", dtype)[lo:lo + split[rank]], dtype,
                             same=False)
        from ..session import session

        probe = self.tensor(data(rank, 1, dtype), dtype)
        backend = session().devices.backend_for(probe, ddl.Sum)
        return backend or "host (staged)"


def check_collectives(ranks: Ranks, grid: str) -> int:
    col = Collectives(ranks)
    sizes = SIM_SIZES if ranks.simulate else SIZES
    rows = []
    for dtype in DTYPES:
        before_cases, before_failed = col.cases, len(col.failed)
        engine = col.one_dtype(dtype, sizes)
        rows.append((dtype, engine, str(col.cases - before_cases),
                     str(len(col.failed) - before_failed)))
    digests = ranks.gather(_digest(col.same))
    wrong = ranks.harness.total(len(col.failed))
    names = ranks.gather(",".join(col.failed[:5]))
    from ..session import session

    details = [f"sizes {', '.join(map(str, sizes))} elements; {ranks.size} ranks; device "
               f"engine {session().devices.describe() or '(none made)'}",
               f"digests of the shared results: {len(set(digests))} distinct over "
               f"{len(digests)} ranks"]
    details += [f"rank {r} failed: {n}" for r, n in enumerate(names) if n]
    bitwise = len(set(digests)) == 1
    ok = wrong == 0 and bitwise
    summary = (f"{col.cases} cases per rank on {len(DTYPES)} dtypes, {wrong} wrong over all "
               f"ranks, {'bitwise equal' if bitwise else 'DIFFERENT'} on every rank")
    return emit(ranks.rank, "pass" if ok else "fail", summary,
                columns=("dtype", "engine", "cases per rank", "wrong on rank 0"),
                rows=rows, details=details)


# ----------------------------------------------------------------------------- DDP
def _train_twins(ranks: Ranks, reference: str) -> tuple[list[Any], list[Any]]:
    """The same small convolutional net trained by DDP on the ``ddl`` backend (the default
    group) and by DDP on ``reference``'s group, same seed, same data."""
    torch = ranks.torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    other = dist.new_group(backend=reference)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
        torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)).to(ranks.dev)
    twins = [copy.deepcopy(net), copy.deepcopy(net)]
    ids = [ranks.dev.index] if ranks.dev.type == "cuda" else None
    models = [DDP(twins[0], device_ids=ids, bucket_cap_mb=0.002),
              DDP(twins[1], device_ids=ids, process_group=other, bucket_cap_mb=0.002)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    gen = torch.Generator().manual_seed(100 + ranks.rank)
    for _ in range(5):
        x = torch.randn(16, 3, 8, 8, generator=gen).to(ranks.dev)
        y = torch.randint(0, 10, (16,), generator=gen).to(ranks.dev)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    del models, opts
    return [list(t.parameters()) for t in twins]


def check_ddp(ranks: Ranks, grid: str) -> int:
    """DDP on ddl vs DDP on nccl (gloo when simulating). With 2 ranks each element is one
    addition, so the results must be bitwise equal; with more, NCCL's ring order depends on
    where an element falls in the buffer, and ddl's buckets may differ from DDP's: there
    the tolerance is 1e-6 and bitwise equality is reported."""
    torch = ranks.torch
    import torch.distributed as dist

    import ddl
    import ddl.torch  # noqa: F401 - registers the "ddl" backend

    dist.init_process_group("ddl", init_method="env://", rank=ranks.rank,
                            world_size=ranks.size)
    reference = "gloo" if ranks.simulate else "nccl"
    try:
        ours, theirs = _train_twins(ranks, reference)
        bitwise = all(torch.equal(a, b) for a, b in zip(ours, theirs))
        diff = max(float((a - b).detach().abs().max()) for a, b in zip(ours, theirs))
        flat = torch.cat([p.detach().reshape(-1) for p in ours]).to("cpu")
        digests = ranks.gather(hashlib.sha256(_bytes(flat)).hexdigest())
    finally:
        dist.destroy_process_group()
    all_bitwise = ranks.harness.total(int(not bitwise)) == 0
    worst = float(ddl.allreduce(np.array([diff]), op=ddl.Max)[0])
    same_ranks = len(set(digests)) == 1
    need_bitwise = ranks.size == 2
    ok = same_ranks and (all_bitwise if need_bitwise else worst <= 1e-6)
    summary = (f"{'bitwise equal' if all_bitwise else f'max |diff| {worst:.3g}'} to DDP on "
               f"{reference} after 5 steps ({ranks.size} ranks); weights "
               f"{'identical' if same_ranks else 'DIFFERENT'} on every rank")
    from ..session import session

    details = [f"{sum(p.numel() for p in ours)} parameters, 5 SGD steps, buckets of 2 KB; "
               f"ddl's device engine: {session().devices.describe() or '(none: host engines)'}",
               "required: bitwise equal" if need_bitwise else
               "required: within 1e-6 (more than 2 ranks: the summation order may differ)"]
    return emit(ranks.rank, "pass" if ok else "fail", summary, details=details)


# ------------------------------------------------------------------------- multidim
def check_multidim(ranks: Ranks, grid: str) -> int:
    """The allreduce over the grid of DDL_OPTIONS, in chunks small enough to pipeline."""
    import ddl

    from ..session import session

    want_dims = len(grid.split("x"))
    col = Collectives(ranks)
    sizes = SIM_SIZES if ranks.simulate else (*SIZES, 4 * 1048576 + 3)
    for dtype in ("float32", "bfloat16", "int32", "float64"):
        for size in sizes:
            xs = [data(r, size, dtype) for r in range(ranks.size)]
            for name, op in (("sum", ddl.Sum), ("max", ddl.Max)):
                col.compare(f"allreduce-{dtype}-{name}-{size}",
                            ddl.allreduce(col.tensor(xs[ranks.rank], dtype), op=op),
                            expected(xs, name, dtype), dtype)
    described = session().devices.describe()
    dims = described.count("->") + 1 if described else 0
    digests = ranks.gather(_digest(col.same))
    wrong = ranks.harness.total(len(col.failed))
    ok = wrong == 0 and len(set(digests)) == 1 and dims == want_dims
    summary = (f"grid {grid}: {dims} dimension(s) run, {col.cases} cases per rank, "
               f"{wrong} wrong, {len(set(digests))} distinct result digest(s) over "
               f"{len(digests)} ranks")
    return emit(ranks.rank, "pass" if ok else "fail", summary,
                details=[f"device engine: {described}",
                         f"DDL_OPTIONS {os.environ.get('DDL_OPTIONS', '')}, DDL_CHUNK_BYTES "
                         f"{os.environ.get('DDL_CHUNK_BYTES', '(default)')}",
                         *[f"rank 0 failed: {f}" for f in col.failed[:5]]])


# ----------------------------------------------------------------------- set_device
def check_set_device(ranks: Ranks, grid: str) -> int:
    """Each rank on the device its LOCAL_RANK names (Ranks called set_device), a collective
    on it whose result stays there."""
    import ddl

    torch = ranks.torch
    if ranks.simulate:
        where = f"cpu:{ranks.local}"
        on_mine = True
    else:
        index = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(index)
        bus = f"{getattr(p, 'pci_bus_id', 0):02x}:{getattr(p, 'pci_device_id', 0):02x}"
        where = f"cuda:{index} {p.name} pci {bus}"
        on_mine = index == ranks.local % torch.cuda.device_count()
    x = torch.full((1001,), float(ranks.rank + 1), device=ranks.dev)
    got = ddl.allreduce(x, op=ddl.Sum)
    right = (got.device == ranks.dev and bool((got == ranks.size * (ranks.size + 1) / 2).all()))
    lines = ranks.gather(f"{ranks.rank}|{ranks.local}|{ddl.local_rank()}|{where}|"
                         f"{int(on_mine and right)}")
    rows = [tuple(line.split("|")) for line in lines]
    devices = [r[3] for r in rows]
    ok = (all(r[4] == "1" and r[1] == r[2] for r in rows)
          and len(set(devices)) == len(devices))
    summary = (f"{len(set(devices))} distinct device(s) for {len(rows)} ranks; allreduce "
               f"result on the rank's own device: {sum(r[4] == '1' for r in rows)} of "
               f"{len(rows)}")
    return emit(ranks.rank, "pass" if ok else "fail", summary,
                columns=("rank", "LOCAL_RANK", "ddl.local_rank()", "device", "ok"),
                rows=rows)


# ----------------------------------------------------------------------- tensorflow
def check_tensorflow(simulate: bool) -> int:
    """ddl.tensorflow's allreduce, allgather and broadcast on tensors on this rank's GPU
    (Horovod's recipe: each process sees only its GPU). Skipped, on every rank alike, where
    TensorFlow is not installed or sees no GPU."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        import tensorflow as tf
    except ImportError as exc:
        return emit(rank, "skip", f"TensorFlow is not installed here ({exc})")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if simulate:
        where = "/CPU:0"
    else:
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return emit(rank, "skip", f"TensorFlow {tf.__version__} sees no GPU (a build "
                                      "without CUDA? tensorflow[and-cuda] brings it)")
        mine = gpus[local % len(gpus)]
        tf.config.experimental.set_memory_growth(mine, True)
        tf.config.set_visible_devices(mine, "GPU")
        where = "/GPU:0"
    import ddl.tensorflow as hvd

    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    failed = []
    with tf.device(where):
        x = tf.constant(data(rank, 1001, "float32"), dtype=tf.float32)
        total = hvd.allreduce(x, op=hvd.Sum)
        gathered = hvd.allgather(tf.fill([rank + 1, 3], float(rank)))
        root = hvd.broadcast(tf.fill([5], float(rank)), root_rank=n - 1)
    want = expected([data(r, 1001, "float32") for r in range(n)], "sum", "float32")
    if not np.array_equal(total.numpy(), want.astype(np.float32)):
        failed.append("allreduce")
    rows_want = np.concatenate([np.full((r + 1, 3), float(r)) for r in range(n)])
    if not np.array_equal(gathered.numpy(), rows_want.astype(np.float32)):
        failed.append("allgather")
    if not np.array_equal(root.numpy(), np.full(5, float(n - 1), np.float32)):
        failed.append("broadcast")
    placed = "GPU" if not simulate else "CPU"
    if placed not in total.device.upper():
        failed.append(f"allreduce result on {total.device}, not on the {placed}")
    everyone = hvd.allgather_object(failed)
    bad = [f"rank {r}: {', '.join(f)}" for r, f in enumerate(everyone) if f]
    hvd.shutdown()
    summary = (f"TensorFlow {tf.__version__}: allreduce, allgather, broadcast on {where} "
               f"tensors over {n} ranks: {'all right' if not bad else 'FAILED'}")
    return emit(rank, "fail" if bad else "pass", summary,
                details=[f"result device: {total.device}", *bad])


CHECKS: dict[str, Callable[[Ranks, str], int]] = {
    "collectives": check_collectives, "ddp": check_ddp, "multidim": check_multidim,
    "set_device": check_set_device,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddl.perf.gpu_check_workers",
                                description="one check of ddl-perf gpu-check, on every rank")
    p.add_argument("check", choices=(*CHECKS, "tensorflow"))
    p.add_argument("--simulate-cpu", action="store_true",
                   help="CPU tensors through the device engine over Gloo (tests)")
    p.add_argument("--grid", default="", metavar="AxB",
                   help="multidim: the grid DDL_OPTIONS describes (checked against the run)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.check == "tensorflow":
        return check_tensorflow(args.simulate_cpu)
    ranks = Ranks(args.simulate_cpu)
    try:
        return CHECKS[args.check](ranks, args.grid)
    finally:
        ranks.close()


if __name__ == "__main__":
    sys.exit(main())
