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

``--hosts 2,3`` (needs root) measures instead the issue's 2x2 -> 1x2 and 3x2 -> 2x2:
simulated hosts of 2 ranks each (network namespaces with sshd,
tests/launcher/netns_cluster.py); the last rank SIGKILLs its whole host right after step 7
(its agent, every worker that agent started, itself), stamping the time just before. Three
styles, alternating round by round:

- ``in-place``: one ddlrun starts every host's workers over ssh through its agents
  (``-H h1:2,h2:2 -np 4 --min-np 2``); the survivors go on in the same processes;
- ``restart``: torchrun's shape with ddlrun, one ddlrun per host (``--nnodes 1:2
  --nproc-per-node 2 --max-restarts 1 --rdzv-endpoint h1:PORT``); the surviving nodes stop
  their workers, form the next round without the lost host and start new workers, which load
  rank 0's checkpoint;
- ``torchrun``: the same with PyTorch's own ``torchrun`` (``--rdzv-backend c10d``) and the
  same script (ddl reads torchrun's environment).

Both restarts use ``--rdzv-conf last_call_timeout=2`` (``--last-call``; the default, 30 s,
would add 28 s to each); torchrun's rendezvous also waits until the lost node's heartbeats
have lapsed. Same measure as above. Every "host" shares this machine's cores, so the times
include that contention. The lost host's processes die with it, so their peers see closed
connections at once: no detection timeout is included.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "elastic_worker.py")
COMMIT = os.path.join(HERE, "elastic_commit.py")
STEPS, EVERY, KILL_STEP = 10, 3, 7
STYLES = ("in-place", "restart")
HOST_STYLES = ("in-place", "restart", "torchrun")  # --hosts: restarts are one agent per node
PER_HOST = 2  # ranks per simulated host (--hosts)
IFACE = "ddl0"  # the simulated hosts' interface (tests/launcher/netns_cluster.py)
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
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
                             "ranks, in place and by restarts (root; default 2,3)")
    parser.add_argument("--last-call", type=float, default=2.0,
                        help="--hosts restarts: the rendezvous' last_call_timeout (default 2)")
    return parser


@dataclass(frozen=True)
class Case:
    """One kind of run: the model, the world size before the loss, the recovery style and
    (``hosts`` > 0) the number of simulated hosts of ``PER_HOST`` ranks, one of them lost."""

    model: str
    ranks: int
    style: str
    hosts: int = 0
    last_call: float = 2.0

    def lost(self) -> int:
        """Ranks lost: a host's, or one."""
        return PER_HOST if self.hosts else 1

    def per_node(self) -> bool:
        """One agent per host (torchrun's shape), not one ddlrun for the job."""
        return bool(self.hosts) and self.style != "in-place"

    def launch(self) -> list[str]:
        """The launcher's flags for this style (a node's, in torchrun's shape)."""
        if self.style == "in-place":
            return ["-np", str(self.ranks), "--min-np", str(self.ranks - self.lost()),
                    "--max-np", str(self.ranks)]
        if not self.hosts:
            return ["-n", str(self.ranks), "--max-restarts", "1"]
        flags = ["--nnodes", f"{self.hosts - 1}:{self.hosts}", "--nproc-per-node",
                 str(PER_HOST), "--max-restarts", "1"]
        return [*flags, "--rdzv-backend", "c10d"] if self.style == "torchrun" else flags

    def worker_args(self, folder: str) -> list[str]:
        style = "inplace" if self.style == "in-place" else "restart"
        args = [WORKER, style, os.path.join(folder, "stamps"), "--model", self.model,
                "--steps", str(STEPS), "--commit", str(EVERY), "--kill-step", str(KILL_STEP)]
        if style == "restart":
            args += ["--ckpt", folder]
        if self.hosts:  # the last rank sits on the last host (ranks fill hosts in order)
            args += ["--kill-rank", str(self.ranks - 1), "--kill-agent"]
        return args

    def node_argvs(self, folder: str, cluster: Any, port: int) -> list[list[str]]:
        """Torchrun's shape: one agent per host of ``cluster``, each in its host's network
        namespace, meeting at the first host's ``port``."""
        rdzv = ["--rdzv-endpoint", f"{cluster.addrs[0]}:{port}", "--rdzv-id", f"er{port}"]
        conf = f"last_call_timeout={self.last_call:g}"
        out = []
        for i, (ns, addr) in enumerate(zip(cluster.host_ns[:self.hosts], cluster.addrs,
                                           strict=False)):
            if self.style == "torchrun":
                # torchrun finds the store's host by its hostname, which every simulated
                # host shares: is_host (torch's documented c10d option) says which it is
                agent = [TORCHRUN, *self.launch(), *rdzv, "--rdzv-conf",
                         f"{conf},is_host={int(i == 0)}", "--local-addr", addr]
            else:
                agent = [sys.executable, "-m", "ddlrun", *self.launch(), *rdzv, "--rdzv-conf",
                         conf, "--network-interface", IFACE, sys.executable]
            out.append(["ip", "netns", "exec", ns, *agent, *self.worker_args(folder)])
        return out

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
        kill = f"--kill-rank {self.ranks - 1} --kill-agent"
        if self.per_node():
            launcher = "torchrun" if self.style == "torchrun" else "ddlrun"
            python = "" if self.style == "torchrun" else " python"
            return (f"{launcher} {' '.join(self.launch())} --rdzv-endpoint h1:PORT "
                    f"--rdzv-conf last_call_timeout={self.last_call:g}{python} "
                    f"benchmarks/elastic_worker.py restart STAMPS --ckpt DIR {kill}"
                    " (on each host)")
        if self.hosts:
            hosts = ",".join(f"h{i + 1}:{PER_HOST}" for i in range(self.hosts))
            return (f"ddlrun -H {hosts} {' '.join(self.launch())} python "
                    f"benchmarks/elastic_worker.py {style} STAMPS {kill}")
        extra = " --ckpt DIR" if style == "restart" else ""
        return (f"ddlrun {' '.join(self.launch())} python benchmarks/elastic_worker.py "
                f"{style} STAMPS --model numpy|torch{extra}")

    def world_after(self) -> int:
        """Ranks in the next world: a restart on one host starts them all again; across
        hosts every style goes on without the lost host."""
        return self.ranks - self.lost() if self.style == "in-place" or self.hosts else self.ranks

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
    started = min(starts) - kills[0] if case.style != "in-place" else None
    return max(firsts) - kills[0], started


def sample(case: Case, cluster: Any = None) -> tuple[float, float | None]:
    """One run of ``case``; its recovery times (``recovery``)."""
    folder = tempfile.mkdtemp(prefix="elastic_recovery.")
    try:
        if case.per_node():
            run_nodes(case, folder, cluster)
        else:
            proc = subprocess.run(case.argv(folder, cluster), capture_output=True, text=True,
                                  timeout=300,
                                  env={**os.environ, **ENV}, cwd=folder)
            if proc.returncode != 0:
                raise RuntimeError(f"{case}: ddlrun exited {proc.returncode}:\n"
                                   f"{(proc.stdout + proc.stderr)[-3000:]}")
        return recovery(case, read_stamps(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def nodes_ended_well(case: Case, codes: list[int]) -> bool:
    """Every node's agent exited 0 but the lost host's, which died of SIGKILL."""
    return (sorted(codes) == sorted([0] * (case.hosts - 1) + [-signal.SIGKILL]))


def run_nodes(case: Case, folder: str, cluster: Any) -> None:
    """One agent per simulated host, the first one (serving the rendezvous) a moment ahead
    of the others, as a scheduler would start them."""
    port = random.randrange(20000, 30000)
    # the nodes share a secret as a scheduler's job would (ddlrun draws one only for a job
    # it starts alone); torchrun's workers pick their interface as gloo users do
    env = {**os.environ, **ENV, "GLOO_SOCKET_IFNAME": IFACE,
           "DDL_JOB_SECRET": f"elastic-recovery-{port}"}
    paths = [os.path.join(folder, f"node{i}.log") for i in range(case.hosts)]
    procs: list[subprocess.Popen] = []
    try:
        for i, argv in enumerate(case.node_argvs(folder, cluster, port)):
            with open(paths[i], "w") as log:
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                              env=env, cwd=folder, start_new_session=True))
            if i == 0:
                time.sleep(1.0)
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if not nodes_ended_well(case, codes):
        text = []
        for i, path in enumerate(paths):
            with open(path) as log:
                text.append(f"--- node {i} exited {codes[i]}:\n{log.read()[-2000:]}")
        raise RuntimeError(f"{case}: the nodes' agents exited {codes}\n" + "\n".join(text))


def measure(cases: Sequence[Case], rounds: int, cluster: Any = None,
            failures: dict[Case, list[str]] | None = None
            ) -> dict[Case, list[tuple[float, float | None]]]:
    """``rounds`` samples of each case; in-place and restart alternate, and which goes
    first swaps every round. With ``failures``, a run that did not recover as it should
    (the wrong world went on, an agent exited wrong) is noted there, and its case gets
    another round, up to ``rounds`` more; without it, such a run stops the measurement."""
    samples: dict[Case, list[tuple[float, float | None]]] = {case: [] for case in cases}
    for number in range(2 * rounds if failures is not None else rounds):
        order = cases if number % 2 == 0 else list(reversed(cases))
        for case in [c for c in order if len(samples[c]) < rounds]:
            try:
                samples[case].append(sample(case, cluster))
            except RuntimeError as exc:
                if failures is None:
                    raise
                failures.setdefault(case, []).append(str(exc).splitlines()[0])
                print(f"# round {number + 1}: {case.model} {case.ranks} {case.style} "
                      f"failed: {failures[case][-1]}", file=sys.stderr, flush=True)
                continue
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
    return lines + [f"| {case.model} | {row(case, samples)}" for case in samples]


def row(case: Case, samples: dict[Case, list[tuple[float, float | None]]]) -> str:
    """A case's cells from its world on: the median, a restart's ratio to the in-place
    recovery of the same world and the median start of its new processes, the samples."""
    values = samples[case]
    if not values:  # every run of it failed (measure's failures say why)
        return f"{case.worlds()} | {case.style} | no run recovered | | | |"
    med = statistics.median(total for total, _ in values)
    ratio = started = ""
    if case.style != "in-place":
        started = fmt(statistics.median(begun for _, begun in values if begun is not None))
        inplace = samples.get(replace(case, style="in-place"))
        if inplace:
            times = med / statistics.median(total for total, _ in inplace)
            ratio = f"{times:.1f}x" if times < 10 else f"{times:.0f}x"
    return (f"{case.worlds()} | {case.style} | {fmt(med)} | {ratio} | {started} | "
            f"{', '.join(f'{total:.3f}' for total, _ in values)} |")


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


def host_styles() -> tuple[str, ...]:
    """The ``--hosts`` styles this venv can run (torchrun comes with torch)."""
    return HOST_STYLES if os.access(TORCHRUN, os.X_OK) else HOST_STYLES[:2]


def hosts_table(samples: dict[Case, list[tuple[float, float | None]]]) -> list[str]:
    """The ``--hosts`` table: each restart beside the in-place recovery of its world."""
    lines = ["| world | style | recovery (median) | / in place | new processes started "
             "after (median) | samples (s) |", "|---|---|---|---|---|---|"]
    return lines + [f"| {row(case, samples)}" for case in samples]


def across_hosts(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--hosts``: a whole simulated host lost, in place and by restarts; the table and
    its notes."""
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
    cases = [Case("numpy", n * PER_HOST, style, hosts=n, last_call=args.last_call)
             for n in counts for style in host_styles()]
    with tempfile.TemporaryDirectory(prefix="elastic_hosts.") as tmp:
        from pathlib import Path

        cluster = Cluster(Path(tmp), nhosts=max(counts))
        try:
            cluster.start()
            failures: dict[Case, list[str]] = {}
            samples = measure(cases, args.rounds, cluster, failures)
        finally:
            cluster.close()
    out = [f"`{shown_command(argv)}` ({os.cpu_count()} CPUs shared by every simulated host)",
           "",
           f"Recovery across hosts: a host of {PER_HOST} ranks lost (its agent and workers "
           f"SIGKILLed right after step {KILL_STEP}; last commit at step "
           f"{KILL_STEP // EVERY * EVERY}) to the first step every rank of the next world "
           f"has completed; numpy model, medians of {args.rounds}.", ""]
    out += hosts_table(samples)
    out += [f"- {case.style}, {case.worlds()}: {len(why)} run(s) did not recover "
            f"and were measured again ({'; '.join(why)})" for case, why in failures.items()]
    out += ["", "Commands: " + "; ".join(f"`{case.shown()}`" for case in cases), "",
            f"Restarts with `last_call_timeout={args.last_call:g}`. Every simulated host "
            "shares this machine's cores, so the times include that contention; the lost "
            "host's processes die with it, so their peers see closed connections at once "
            "and no detection timeout is included."]
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"recovery": [{"model": c.model, "ranks": c.ranks, "hosts": c.hosts,
                                     "style": c.style, "samples": [t for t, _ in v],
                                     "started": [b for _, b in v]}
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
