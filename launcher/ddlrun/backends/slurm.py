"""Slurm backend: one ``srun`` inside the allocation, block distribution (host by host, as
the plan places ranks), ``--kill-on-bad-exit`` for fail-fast, every rank wrapped in
``python -m ddlrun.rankenv``. Env values travel in srun's environment (``--export=ALL``).

srun exits with the highest code of its tasks, so when rank 3 exits with 7 and srun then
terminates the others (143), srun says 143. The first task srun reports as ended badly
(``srun: error: node2: task 3: Exited with exit code 7``) is the failure: ddlrun names that
rank and exits with its code, as with the other launchers."""

from __future__ import annotations

import re
import shutil
import signal
import threading

from ..errors import UsageError
from ..events import describe_code
from ..output import OutputSink
from ..plan import JobPlan
from .single import SingleLauncherBackend

# srun's own line for tasks that ended badly: "srun: error: node2: task 3: Exited with exit
# code 7", "srun: error: node1: tasks 0-1: Killed" (the reason is strsignal's text)
TASK_ENDED = re.compile(r"^srun: error: (?P<node>[^\s:]+): tasks? (?P<rank>\d+)[-,\d]*: "
                        r"(?P<why>.+?)\s*$")
EXITED = re.compile(r"^Exited with exit code (\d+)$")
SIGNAL_TEXT = {signal.strsignal(s): s for s in signal.valid_signals()
               if isinstance(s, signal.Signals) and signal.strsignal(s)}


def task_failure(line: str) -> tuple[int, str, int] | None:
    """``(rank, node, code)`` from srun's line for a task that ended badly (code negative:
    killed by that signal), else None."""
    m = TASK_ENDED.match(line)
    if not m:
        return None
    why = m["why"]
    if ex := EXITED.match(why):
        code = int(ex[1])
    elif why.removesuffix(" (core dumped)") in SIGNAL_TEXT:
        code = -SIGNAL_TEXT[why.removesuffix(" (core dumped)")]
    else:
        return None
    return (int(m["rank"]), m["node"], code) if code else None


class SlurmBackend(SingleLauncherBackend):
    name = "slurm"

    def __init__(self, opts) -> None:
        super().__init__(opts)
        self._lock = threading.Lock()
        self.first_failure: tuple[int, str, int] | None = None

    @staticmethod
    def exists() -> bool:
        return shutil.which("srun") is not None

    def validate(self, plan: JobPlan) -> None:
        if not self.exists():
            raise UsageError("--launcher slurm: srun not found on PATH (run inside an "
                             "allocation: salloc / sbatch)")

    def get_cmd(self, plan: JobPlan) -> list[str]:
        counts = {len(h.ranks) for h in plan.hosts}
        argv = ["srun", f"--nodes={len(plan.hosts)}", f"--ntasks={plan.world_size}",
                "--nodelist=" + ",".join(h.host.name for h in plan.hosts),
                "--distribution=block", "--kill-on-bad-exit=1", "--export=ALL",
                "--cpu-bind=none"]
        if len(counts) == 1:
            argv.append(f"--ntasks-per-node={counts.pop()}")
        if self.opts.tag_output:
            argv.append("--label")
        argv += list(self.opts.mpiargs)
        return argv + self.rank_command(plan)

    def watch(self, stream: str, text: str, sink: OutputSink) -> None:
        if stream != "stderr" or not text.startswith("srun: error: "):
            return
        found = task_failure(text.rstrip("\r\n"))
        with self._lock:
            if found is None or self.first_failure is not None:
                return
            self.first_failure = found
        rank, node, code = found
        sink.note(f"rank {rank} on host {node} {describe_code(code)}; srun stops the other "
                  "ranks (--kill-on-bad-exit)")

    def job_code(self, code: int) -> int:
        with self._lock:
            first = self.first_failure
        return first[2] if first is not None and code != 0 else code
