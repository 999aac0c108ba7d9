"""The blame trials of issue 26: does ddlrun name the rank that crashed, every time?

    python benchmarks/blame_trials.py [--trials N] [--programs numpy,ddp,keras]
                                      [--out DIR] [--seed S] [--timeout S]

Three programs, written to a temporary folder, each a loop in which one rank (VICTIM)
raises ``ValueError("boom on rank VICTIM")`` at a random point (AT) while its peers wait in
a collective:

- ``numpy``: ``ddl.allreduce`` of a small array; VICTIM raises before allreduce AT;
- ``ddp``: DDP on the ``ddl`` torch backend (``import ddl.torch``,
  ``init_process_group("ddl")``); VICTIM raises in epoch 1 before step AT;
- ``keras``: Keras 3 ``model.fit`` with ``ddl.keras`` (DistributedOptimizer and Horovod's
  callbacks); VICTIM raises from a callback's ``on_train_batch_end`` at batch AT.

Each trial runs ``python -m ddlrun -np P python PROGRAM VICTIM AT`` (P: 2 for keras, 2 to 4
for the others; VICTIM random in range(P)) from the programs' folder and reads ddlrun's
summary (``parse_summary``). It is right when (``judge``) the culprit named is VICTIM with
the program's raising line as its frame (``at blame_numpy.py:LINE``), the culprit's last
lines shown hold that frame and the exception, no other rank is named as a cause (no
"failed too", no stopped rank called the likely cause, follow-on failures only of VICTIM)
and ddlrun exits with VICTIM's code, 1. Trials are random but reproducible: each program's
draws come from ``--seed`` and its name, so a subset of programs draws the same trials.

Printed: a ``#``-headed table (program, trials, right, wrong, seconds in all and per trial);
DIR (``--out``, else a new temporary folder) gets ``results.json`` (the same rows) and, for
each wrong trial, ``PROGRAM-TRIAL.txt`` (the command, the draw, what is wrong, ddlrun's
stdout and stderr) with a copy of the program beside it to reproduce it. A program whose
framework is not installed is listed as skipped. Exit status 1 when any trial was wrong.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

MARK = "# CRASH"  # the raising line of every program ends with this

NUMPY = '''"""Blame trial: ddl.allreduce in a loop; rank VICTIM raises before allreduce AT."""
import sys

import numpy as np

import ddl


def main(victim: int, at: int) -> None:
    ddl.init()
    buf = np.ones(4, np.float32)
    for step in range(at + 50):
        if step == at and ddl.rank() == victim:
            raise ValueError(f"boom on rank {victim}")  # CRASH
        ddl.allreduce(buf)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
'''

DDP = '''"""Blame trial: DDP on the ddl backend; rank VICTIM raises in epoch 1 before step AT."""
import sys

import torch
import torch.distributed as dist

import ddl.torch  # noqa: F401 - registers the "ddl" backend


def main(victim: int, at: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("ddl", init_method="env://")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(3):
        for step in range(8):
            if epoch == 1 and step == at and dist.get_rank() == victim:
                raise ValueError(f"boom on rank {victim}")  # CRASH
            opt.zero_grad()
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
'''

KERAS = '''"""Blame trial: Keras fit with ddl.keras; rank VICTIM raises from a callback at batch AT
(counted over the whole fit)."""
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras  # noqa: E402
import numpy as np  # noqa: E402

import ddl.keras as hvd  # noqa: E402


class Crash(keras.callbacks.Callback):
    def __init__(self, victim: int, at: int) -> None:
        super().__init__()
        self.victim, self.at, self.batches = victim, at, 0

    def on_train_batch_end(self, batch, logs=None):
        if self.batches == self.at and hvd.rank() == self.victim:
            raise ValueError(f"boom on rank {self.victim}")  # CRASH
        self.batches += 1


def main(victim: int, at: int) -> None:
    hvd.init()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((64, 6)).astype("float32")
    y = rng.integers(0, 3, 64)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback(), Crash(victim, at)])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
'''


@dataclass(frozen=True)
class Program:
    """One crashing program: its source, what it needs, and how a trial is drawn."""

    name: str
    source: str
    needs: tuple[str, ...]  # modules that must be importable
    ranks: tuple[int, ...]  # the job sizes drawn from
    at: tuple[int, int]  # AT drawn from this closed range
    timeout: float  # seconds a trial may take (2 slow cores shared with others)

    @property
    def filename(self) -> str:
        return f"blame_{self.name}.py"

    @property
    def line(self) -> int:
        """The line number of the raising line."""
        return next(i for i, text in enumerate(self.source.splitlines(), 1)
                    if text.endswith(MARK))

    def missing(self) -> str | None:
        """The first module this program needs that is not installed, else None."""
        return next((m for m in self.needs if importlib.util.find_spec(m) is None), None)


PROGRAMS = {p.name: p for p in (
    Program("numpy", NUMPY, ("numpy",), (2, 3, 4), (0, 30), 120.0),
    Program("ddp", DDP, ("torch",), (2, 3, 4), (0, 7), 300.0),
    Program("keras", KERAS, ("tensorflow", "keras"), (2,), (1, 20), 600.0),
)}


# ---------------------------------------------------------------------- the summary
_RANK_NOTE = re.compile(r"^ddlrun: rank (\d+) on host (\S+)(?: \(pid \d+\))? (.*)$")
_TAIL_HEAD = re.compile(r"^ddlrun: last \d+ line\(s\) of rank (\d+):$")
_TAIL_LINE = "ddlrun:   | "
_FOLLOW_ON = re.compile(r"follow-on failures of (rank \d+|host \S+)")


@dataclass(frozen=True)
class Summary:
    """What ddlrun's summary (its ``ddlrun:`` lines on stderr) says about a failed job."""

    culprit: int | None = None  # the rank blamed: "rank N on host H (pid P) ... stopping"
    culprit_note: str = ""  # that whole line
    tail: tuple[str, ...] = ()  # the culprit's last lines, as shown
    likely_causes: tuple[int, ...] = ()  # stopped ranks called the (likely) cause
    also_failed: tuple[int, ...] = ()  # other ranks with a cause of their own ("too, later")
    follow_on_of: tuple[str, ...] = ()  # "rank N" / "host H" whose follow-on failures these are
    no_cause: bool = False  # "no rank reported a cause of its own"


def parse_summary(stderr: str) -> Summary:
    """ddlrun's summary in ``stderr`` (the ranks' own lines, ``[N]``-prefixed, are skipped)."""
    culprit, note, tail, tail_of = None, "", [], None
    likely, also, follow, no_cause = [], [], [], False
    for text in stderr.splitlines():
        if not text.startswith("ddlrun:"):
            continue
        if text.startswith(_TAIL_LINE):  # a rank's (or the launcher's) own line, shown
            if tail_of is not None and tail_of == culprit:
                tail.append(text[len(_TAIL_LINE):])
            continue
        tail_of = None
        if m := _TAIL_HEAD.match(text):
            tail_of = int(m.group(1))
        elif m := _RANK_NOTE.match(text):
            rank, rest = int(m.group(1)), m.group(3)
            if "it is the likely cause" in rest or rest.startswith("is "):
                likely.append(rank)
            elif "failed too, later" in rest:
                also.append(rank)
            elif culprit is None and ("stopping the other ranks" in rest
                                      or rest.startswith("failed first:")):
                culprit, note = rank, text
        follow += _FOLLOW_ON.findall(text)
        no_cause = no_cause or "reported a cause of its own" in text
    return Summary(culprit, note, tuple(tail), tuple(likely), tuple(also), tuple(follow),
                   no_cause)


def judge(summary: Summary, returncode: int, victim: int, filename: str, line: int
          ) -> list[str]:
    """What is wrong with the summary of a job whose rank ``victim`` raised ``ValueError``
    on ``filename``'s ``line`` (empty: it is right)."""
    wrong = []
    if summary.culprit != victim:
        wrong.append(f"named rank {summary.culprit} as the culprit, not rank {victim}: "
                     f"{summary.culprit_note!r}")
    exc = f"ValueError: boom on rank {victim}"
    frame = re.compile(rf"{exc} at (\S*/)?{re.escape(filename)}:{line} ")
    if summary.culprit == victim and not frame.search(summary.culprit_note):
        wrong.append(f"the culprit's note lacks {exc!r} at {filename}:{line}: "
                     f"{summary.culprit_note!r}")
    shown = re.compile(rf'File "(\S*/)?{re.escape(filename)}", line {line}\b')
    if not any(shown.search(text) for text in summary.tail):
        wrong.append(f"the culprit's last lines lack its frame {filename}:{line}")
    # (torch prefixes its ranks' tracebacks with "[rankN]: ")
    if not any(text.removeprefix(f"[rank{victim}]: ") == exc for text in summary.tail):
        wrong.append(f"the culprit's last lines lack {exc!r}")
    others = sorted({*summary.likely_causes, *summary.also_failed} - {victim})
    if others:
        wrong.append(f"rank(s) {others} named as a cause too")
    if any(cause != f"rank {victim}" for cause in summary.follow_on_of):
        wrong.append(f"follow-on failures of {list(summary.follow_on_of)}, "
                     f"not of rank {victim}")
    if summary.no_cause:
        wrong.append("says no rank reported a cause of its own")
    if returncode != 1:
        wrong.append(f"ddlrun exited with {returncode}, not the culprit's 1")
    return wrong


# ---------------------------------------------------------------------- the trials
@dataclass(frozen=True)
class Trial:
    program: str
    index: int
    ranks: int
    victim: int
    at: int


@dataclass(frozen=True)
class Ran:
    """A trial's outcome (``timed_out``: ddlrun was stopped after the program's timeout)."""

    trial: Trial
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False


@dataclass
class Row:
    program: str
    trials: int = 0
    right: int = 0
    wrong: int = 0
    seconds: float = 0.0
    skipped: str = ""  # why the program did not run
    wrong_files: list[str] = field(default_factory=list)


def draw(program: Program, trials: int, seed: int) -> list[Trial]:
    """``trials`` draws of (ranks, victim, at) for ``program``, from ``seed`` and its name."""
    rng = random.Random(f"{seed}:{program.name}")
    out = []
    for i in range(trials):
        n = rng.choice(program.ranks)
        out.append(Trial(program.name, i, n, rng.randrange(n), rng.randint(*program.at)))
    return out


def ddlrun_argv(path: str, trial: Trial) -> list[str]:
    return [sys.executable, "-m", "ddlrun", "-np", str(trial.ranks), sys.executable, path,
            str(trial.victim), str(trial.at)]


def run_trial(folder: str, program: Program, trial: Trial, timeout: float | None = None
              ) -> Ran:
    """One ddlrun job of ``program`` (written in ``folder``), run from ``folder``. On the
    timeout ddlrun gets SIGTERM (it stops its ranks), then SIGKILL 30 s later."""
    argv = ddlrun_argv(os.path.join(folder, program.filename), trial)
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout or program.timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        timed_out = True
    return Ran(trial, tuple(argv), proc.returncode, out, err, time.monotonic() - start,
               timed_out)


def problems(ran: Ran, program: Program) -> list[str]:
    found = judge(parse_summary(ran.stderr), ran.returncode, ran.trial.victim,
                  program.filename, program.line)
    return ([f"timed out after {ran.seconds:.0f} s"] if ran.timed_out else []) + found


def save_wrong(out: str, program: Program, ran: Ran, wrong: Sequence[str]) -> str:
    """The wrong trial's file in ``out`` (and the program beside it); its path."""
    copy = os.path.join(out, program.filename)
    if not os.path.exists(copy):
        with open(copy, "w") as f:
            f.write(program.source)
    path = os.path.join(out, f"{program.name}-{ran.trial.index:03d}.txt")
    t = ran.trial
    with open(path, "w") as f:
        f.write(f"# {program.name} trial {t.index}: {t.ranks} ranks, victim {t.victim}, "
                f"at {t.at}; exit code {ran.returncode}; {ran.seconds:.1f} s\n"
                f"# command (from the folder of {program.filename}, a copy is beside this "
                f"file): {' '.join(ran.argv)}\n")
        f.writelines(f"# wrong: {w}\n" for w in wrong)
        f.write(f"\n=== stdout\n{ran.stdout}\n=== stderr\n{ran.stderr}")
    return path


def run_program(program: Program, trials: int, seed: int, out: str,
                timeout: float | None = None,
                progress: Callable[[str], None] | None = None) -> Row:
    """``trials`` trials of ``program``; wrong ones saved in ``out``."""
    row = Row(program.name)
    missing = program.missing()
    if missing:
        row.skipped = f"needs {missing}"
        return row
    folder = tempfile.mkdtemp(prefix=f"blame-{program.name}-")
    try:
        with open(os.path.join(folder, program.filename), "w") as f:
            f.write(program.source)
        for trial in draw(program, trials, seed):
            ran = run_trial(folder, program, trial, timeout)
            wrong = problems(ran, program)
            row.trials += 1
            row.seconds += ran.seconds
            if wrong:
                row.wrong += 1
                row.wrong_files.append(save_wrong(out, program, ran, wrong))
            else:
                row.right += 1
            if progress:
                progress(f"{program.name} {trial.index}: {trial.ranks} ranks, victim "
                         f"{trial.victim}, at {trial.at}: {'WRONG' if wrong else 'right'} "
                         f"({ran.seconds:.1f} s)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return row


def table(rows: Sequence[Row], seed: int, out: str) -> str:
    lines = [f"# blame trials (issue 26): seed {seed}; wrong trials' outputs in {out}",
             f"# {'program':<8} {'trials':>6} {'right':>6} {'wrong':>6} {'time_s':>8} "
             f"{'per_trial_s':>11}"]
    for r in rows:
        if r.skipped:
            lines.append(f"  {r.program:<8} skipped: {r.skipped}")
            continue
        per = r.seconds / r.trials if r.trials else 0.0
        lines.append(f"  {r.program:<8} {r.trials:>6} {r.right:>6} {r.wrong:>6} "
                     f"{r.seconds:>8.1f} {per:>11.2f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Crash a random rank of a numpy, DDP and Keras job under ddlrun, N times "
                    "each; check that ddlrun blames that rank with its frame (issue 26).")
    parser.add_argument("--trials", type=int, default=100, help="trials per program (100)")
    parser.add_argument("--programs", default=",".join(PROGRAMS),
                        help=f"comma-separated, of {', '.join(PROGRAMS)} (all)")
    parser.add_argument("--out", help="folder for results.json and the wrong trials' "
                                      "outputs (default: a new temporary folder)")
    parser.add_argument("--seed", type=int, help="the draws' seed (default: random, printed)")
    parser.add_argument("--timeout", type=float,
                        help="seconds per trial (default: numpy 120, ddp 300, keras 600)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no line per trial")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.programs.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown or not names:
        parser.error(f"--programs: unknown {unknown or names}; choose of {', '.join(PROGRAMS)}")
    if args.trials < 1:
        parser.error(f"--trials must be at least 1, not {args.trials}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    out = args.out or tempfile.mkdtemp(prefix="blame-trials-")
    os.makedirs(out, exist_ok=True)
    say = None if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    rows = [run_program(PROGRAMS[n], args.trials, seed, out, args.timeout, say)
            for n in names]
    print(table(rows, seed, out), flush=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"seed": seed, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 1 if any(r.wrong for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
