"""How fast a job goes on after losing a worker: Horovod-style in-place elastic training
against a torchrun-style restart from a checkpoint, side by side, and what a commit
costs (the table in docs/performance.md)::

    python benchmarks/elastic_recovery.py [--rounds 5] [--worlds 3,4] [--torch-worlds 3]
                                          [--json out.json]
    python benchmarks/elastic_recovery.py --hosts [2,3] [--rounds 5]   # root: netns hosts

Recovery is timed from the loss to the first training step the survivors complete:
the killed worker stamps ``time.time()`` right before it SIGKILLs itself, every rank
stamps each step it completes (benchmarks/elastic_worker.py), and a sample is the
latest, over the ranks of the next world, of their first step in it (every survivor has
gone on). One run per sample:

- ``in-place``: ``ddlrun -np N --min-np N-1 --max-np N``; ``@elastic.run`` restores the
  last in-memory commit and the N-1 survivors go on in the re-formed world, in the same
  processes;
- ``restart``: ``ddlrun -n N --max-restarts 1``; ddlrun stops every rank and starts N new
  ones, which load the checkpoint rank 0 wrote atomically at the last commit (the time
  includes process start, imports, ``init`` and the load).

Both run the same steps (a gradient averaged with one allreduce, then applied), a commit
every 3 steps and the loss right after step 7, so both redo step 7. ``numpy``: a float32
vector of 1 M parameters; ``torch``: an MLP of about 1 M parameters under ``ddl.torch``'s
``DistributedOptimizer``. The two styles alternate (and swap which goes first) round by
round, so the noise of a shared machine falls on both alike; medians of ``--rounds``.
Then ``elastic_commit.py`` times a commit of a 25 M-parameter model on one rank.

By default all on one host: a single rank is lost, 3 -> 2 and 4 -> 3. On one host a dead
peer is seen at once (its pid is gone), so the detection timeout of a lost remote host is
not part of these numbers.

``--hosts 2,3`` (needs root) measures instead the issue's 2x2 -> 1x2 and 3x2 -> 2x2, in
place only: simulated hosts of 2 ranks each (network namespaces with sshd,
tests/launcher/netns_cluster.py), ddlrun starting their workers over ssh through its agent;
the last rank (on the last host) SIGKILLs its host's agent right after step 7, stamping the
time just before, and the host's workers die with it. Same measure as above. Every "host"
shares this machine's cores, so the times include that contention. ddlrun has no
torchrun-style restart across hosts yet (``--max-restarts`` is one host only), so there is
no restart to compare with.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "elastic_worker.py")
COMMIT = os.path.join(HERE, "elastic_commit.py")
STEPS, EVERY, KILL_STEP = 10, 3, 7
STYLES = ("in-place", "restart")
PER_HOST = 2  # ranks per simulated host (--hosts)
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="samples per case (default 5)")
    parser.add_argument("--worlds", default="3,4",
                        help="world sizes for the numpy model, comma-separated (default 3,4)")
    parser.add_argument("--torch-worlds", default="3",
                        help="world sizes for the torch model ('' for none; default 3)")
    parser.add_argument("--json", help="also write every sample to this file")
    parser.add_argument("--hosts", nargs="?", const="2,3", metavar="N,...",
                        help=f"instead: lose a whole host of N simulated hosts x {PER_HOST} "
                             "ranks, in place (root; default 2,3)")
    return parser


@dataclass(frozen=True)
class Case:
    """One kind of run: the model, the world size before the loss, the recovery style and
    (``hosts`` > 0) the number of simulated hosts of ``PER_HOST`` ranks, one of them lost."""

    model: str
    ranks: int
    style: str
    hosts: int = 0

    def lost(self) -> int:
        """Ranks lost: a host's, or one."""
        return PER_HOST if self.hosts else 1

    def launch(self) -> list[str]:
        """ddlrun's flags for this style."""
        if self.style == "in-place":
            return ["-np", str(self.ranks), "--min-np", str(self.ranks - self.lost()),
                    "--max-np", str(self.ranks)]
        return ["-n", str(self.ranks), "--max-restarts", "1"]

    def worker_args(self, folder: str) -> list[str]:
        style = "inplace" if self.style == "in-place" else "restart"
        args = [WORKER, style, os.path.join(folder, "stamps"), "--model", self.model,
                "--steps", str(STEPS), "--commit", str(EVERY), "--kill-step", str(KILL_STEP)]
        if style == "restart":
            args += ["--ckpt", folder]
        if self.hosts:  # the last rank sits on the last host (ranks fill hosts in order)
            args += ["--kill-rank", str(self.ranks - 1), "--kill-agent"]
        return args

    def argv(self, folder: str, cluster: Any = None) -> list[str]:
        """The whole command, its stamps and checkpoint in ``folder``; across the hosts of
        ``cluster`` (a netns_cluster.Cluster) when the case has hosts."""
        if not self.hosts:
            return [sys.executable, "-m", "ddlrun", *self.launch(), sys.executable,
                    *self.worker_args(folder)]
        return cluster.in_launcher([
            sys.executable, "-m", "ddlrun", *cluster.ddlrun_opts(), "-H",
            cluster.hosts(self.hosts, PER_HOST), *self.launch(), sys.executable,
            *self.worker_args(folder)])

    def shown(self) -> str:
        """The command as a user types it."""
        style = "inplace" if self.style == "in-place" else "restart"
        if self.hosts:
            hosts = ",".join(f"h{i + 1}:{PER_HOST}" for i in range(self.hosts))
            return (f"ddlrun -H {hosts} {' '.join(self.launch())} python "
                    f"benchmarks/elastic_worker.py {style} STAMPS "
                    f"--kill-rank {self.ranks - 1} --kill-agent")
        extra = " --ckpt DIR" if style == "restart" else ""
        return (f"ddlrun {' '.join(self.launch())} python benchmarks/elastic_worker.py "
                f"{style} STAMPS --model numpy|torch{extra}")

    def world_after(self) -> int:
        return self.ranks - self.lost() if self.style == "in-place" else self.ranks

    def worlds(self) -> str:
        """The world sizes before and after, as ``hosts x ranks`` across hosts."""
        if not self.hosts:
            return f"{self.ranks} -> {self.world_after()}"
        return f"{self.hosts}x{PER_HOST} -> {self.hosts - 1}x{PER_HOST}"


def read_stamps(folder: str) -> list[list[dict]]:
    """Every process's stamps, one list per process."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "stamps.*"))):
        with open(path) as f:
            out.append([json.loads(line) for line in f if line.strip()])
    return out


def recovery(case: Case, stamps: list[list[dict]]) -> tuple[float, float | None]:
    """Seconds from the kill stamp to the moment every rank of the next world has
    completed a step in it, and (restart only) to the first of its new processes'
    start; checks the run went on to the last step in that world."""
    kills = [s["kill"] for proc in stamps for s in proc if "kill" in s]
    firsts, starts, lasts = [], [], []
    for proc in stamps:
        after = [s for s in proc if s.get("world", 0) >= 1]
        if after:
            firsts.append(after[0]["t"])
            starts += [s["start"] for s in proc if "start" in s]
            lasts.append(after[-1])
    if len(kills) != 1 or len(firsts) != case.world_after():
        raise RuntimeError(f"{case}: {len(kills)} kill stamps, {len(firsts)} ranks went on "
                           f"(expected 1 and {case.world_after()})")
    wrong = [s for s in lasts if s["step"] != STEPS or s["size"] != case.world_after()]
    if wrong:
        raise RuntimeError(f"{case}: the next world ended wrong: {wrong}")
    started = min(starts) - kills[0] if case.style == "restart" else None
    return max(firsts) - kills[0], started


def sample(case: Case, cluster: Any = None) -> tuple[float, float | None]:
    """One run of ``case``; its recovery times (``recovery``)."""
    folder = tempfile.mkdtemp(prefix="elastic_recovery.")
    try:
        proc = subprocess.run(case.argv(folder, cluster), capture_output=True, text=True,
                              timeout=300,
                              env={**os.environ, **ENV}, cwd=folder)
        if proc.returncode != 0:
            raise RuntimeError(f"{case}: ddlrun exited {proc.returncode}:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        return recovery(case, read_stamps(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def measure(cases: Sequence[Case], rounds: int,
            cluster: Any = None) -> dict[Case, list[tuple[float, float | None]]]:
    """``rounds`` samples of each case; in-place and restart alternate, and which goes
    first swaps every round."""
    samples: dict[Case, list[tuple[float, float | None]]] = {case: [] for case in cases}
    for number in range(rounds):
        order = cases if number % 2 == 0 else list(reversed(cases))
        for case in order:
            samples[case].append(sample(case, cluster))
            print(f"# round {number + 1}: {case.model} {case.ranks} {case.style} "
                  f"{samples[case][-1][0]:.3f} s", file=sys.stderr, flush=True)
    return samples


def commit_cost(rounds: int) -> dict:
    proc = subprocess.run([sys.executable, COMMIT, "--repeats", str(rounds)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **ENV})
    if proc.returncode != 0:
        raise RuntimeError(f"elastic_commit.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def recovery_table(samples: dict[Case, list[tuple[float, float | None]]]) -> list[str]:
    lines = ["| model | world | style | recovery (median) | restart / in-place "
             "| new processes started after (median) | samples (s) |",
             "|---|---|---|---|---|---|---|"]
    for case, values in samples.items():
        med = statistics.median(total for total, _ in values)
        inplace = samples.get(Case(case.model, case.ranks, "in-place"))
        ratio = started = ""
        if case.style == "restart":
            started = fmt(statistics.median(begun for _, begun in values if begun is not None))
            if inplace:
                ratio = f"{med / statistics.median(total for total, _ in inplace):.1f}x"
        world = case.worlds()
        lines.append(f"| {case.model} | {world} | {case.style} | {fmt(med)} | {ratio} | "
                     f"{started} | {', '.join(f'{total:.3f}' for total, _ in values)} |")
    return lines


def commit_table(cost: dict) -> list[str]:
    label = {
        "torchstate": f"`TorchState(model, Adam).commit()`, {cost['params'] / 1e6:.1f} M params",
        "torch-ckpt": "`torch.save` of the same + `os.replace` (restart style)",
        "objectstate": f"`ObjectState(params=<{cost['array_bytes'] >> 20} MB array>).commit()`",
        "numpy-ckpt": "`np.save` of that array + `os.replace`",
    }
    lines = ["| what (1 rank) | median | samples (s) |", "|---|---|---|"]
    for name, text in label.items():
        lines.append(f"| {text} | {fmt(cost['medians'][name])} | "
                     f"{', '.join(f'{v:.4f}' for v in cost[name])} |")
    return lines


def sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def shown_command(argv: list[str] | None) -> str:
    return ("python benchmarks/elastic_recovery.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)).strip()


def across_hosts(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--hosts``: a whole simulated host lost, in place; the table and its notes."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "launcher"))
    from netns_cluster import Cluster, unavailable

    why = unavailable()
    if why:
        print(f"elastic_recovery.py --hosts: {why}", file=sys.stderr)
        return 2
    counts = sizes(args.hosts)
    if not counts or min(counts) < 2:
        print("elastic_recovery.py --hosts: every count must be 2 or more", file=sys.stderr)
        return 2
    cases = [Case("numpy", n * PER_HOST, "in-place", hosts=n) for n in counts]
    with tempfile.TemporaryDirectory(prefix="elastic_hosts.") as tmp:
        from pathlib import Path

        cluster = Cluster(Path(tmp), nhosts=max(counts))
        try:
            cluster.start()
            samples = measure(cases, args.rounds, cluster)
        finally:
            cluster.close()
    out = [f"`{shown_command(argv)}` ({os.cpu_count()} CPUs shared by every simulated host)",
           "",
           f"Recovery across hosts: a host of {PER_HOST} ranks lost (its ddlrun agent "
           f"SIGKILLed right after step {KILL_STEP}, its workers dying with it; last commit "
           f"at step {KILL_STEP // EVERY * EVERY}) to the first step every rank of the next "
           f"world has completed; numpy model, medians of {args.rounds}.", ""]
    out += ["| world | style | recovery (median) | samples (s) |", "|---|---|---|---|"]
    out += [f"| {case.worlds()} | {case.style} | "
            f"{fmt(statistics.median(total for total, _ in values))} | "
            f"{', '.join(f'{total:.3f}' for total, _ in values)} |"
            for case, values in samples.items()]
    out += ["", "Commands: " + "; ".join(f"`{case.shown()}`" for case in cases), "",
            "No restart to compare with: ddlrun has no torchrun-style restart across hosts "
            "yet (`--max-restarts` is one host only). Every simulated host shares this "
            "machine's cores, so the times include that contention; the lost host's workers "
            "die with their processes, so their peers see closed connections at once and no "
            "detection timeout is included."]
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"recovery": [{"model": c.model, "ranks": c.ranks, "hosts": c.hosts,
                                     "style": c.style, "samples": [t for t, _ in v]}
                                    for c, v in samples.items()]}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.hosts is not None:
        return across_hosts(args, argv)
    cases = [Case(model, ranks, style)
             for model, worlds in (("numpy", sizes(args.worlds)),
                                   ("torch", sizes(args.torch_worlds)))
             for ranks in worlds for style in STYLES]
    samples = measure(cases, args.rounds)
    cost = commit_cost(args.rounds)
    out = [f"`{shown_command(argv)}` ({os.cpu_count()} CPUs, one host)", "",
           "Recovery: from the SIGKILL of one rank (right after step "
           f"{KILL_STEP}; last commit at step {KILL_STEP // EVERY * EVERY}) to the first step "
           "every rank of the next world has completed; medians of "
           f"{args.rounds}.", ""]
    out += recovery_table(samples)
    out += ["", "Commands: " + "; ".join(f"`{case.shown()}`" for case in cases[:2]), "",
            "A lost host of several ranks (the issue's 2x2 -> 1x2 and 3x2 -> 2x2): "
            "`--hosts` (simulated hosts, needs root). On one host a dead peer is seen at "
            "once, so no detection timeout is included.", "",
            f"Commit cost (medians of {args.rounds}; a `TorchState` commit copies the model "
            "and Adam's two moments to host memory, an `ObjectState` commit keeps a reference "
            "to each value, as Horovod's does: no copy, so a value changed in place is not "
            "undone by a restore):", ""]
    out += commit_table(cost)
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"recovery": [{"model": c.model, "ranks": c.ranks, "style": c.style,
                                     "samples": [total for total, _ in v],
                                     "started": [begun for _, begun in v]}
                                    for c, v in samples.items()],
                       "commit": cost}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
