"""Asking a job's ranks what they are doing: their flight recorders and stacks.

Every rank of a ddlrun job keeps its flight recorder's files in the job's folder on its
host (``DDL_FLIGHT_DIR``, :func:`flight_folder`): ``rank<N>.pid`` from ``ddl.init()``,
``rank<N>.json`` (the ring, the program's frame, every thread's Python stack) when it dumps,
``rank<N>.stacks.txt`` (faulthandler's C-level stacks). ``SIGURG`` asks a rank for both;
its default action is to do nothing, so a process that never installed the handler is not
hurt by it.

When a job fails, ddlrun asks the ranks still alive on its own host (:func:`ask`) before
stopping them, so the diagnosis can name a rank that is stuck rather than failed.
``ddlrun --diagnose [JOB]`` (:func:`diagnose_job`) asks a live job's ranks on this host,
with py-spy where it is installed (it reads a stack from outside, even of a process stuck
in C code), and prints the same diagnosis.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping

from .errors import LaunchError
from .flight_report import diagnose, frame_from_stacks

ASK_WAIT = 1.0  # seconds a failing job's live ranks get to dump before they are stopped
PYSPY_TIMEOUT = 20.0
MAX_DUMP_BYTES = 8 << 20


def flight_base() -> str:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"ddl-flight-{uid}")


def private(folder: str) -> bool:
    """Whether ``folder`` is a real folder of this user that nobody else can write (what
    ddl makes; another user's folder of that name is not trusted)."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def flight_folder(job_id: str) -> str:
    """The job's folder of flight recorder files on this host (``DDL_FLIGHT_DIR``)."""
    return os.path.join(flight_base(), job_id)


def read_dump(folder: str, rank: int) -> dict | None:
    path = os.path.join(folder, f"rank{rank}.json")
    try:
        if os.path.getsize(path) > MAX_DUMP_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_stacks_frame(folder: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(folder, f"rank{rank}.stacks.txt"), encoding="utf-8",
                  errors="replace") as f:
            return frame_from_stacks(f.read()[-MAX_DUMP_BYTES:])
    except OSError:
        return None


def ask(pids: Mapping[int, int], folder: str, wait: float = ASK_WAIT,
        clock: Callable[[], float] = time.monotonic) -> tuple[dict[int, dict], set[int]]:
    """Send ``SIGURG`` to each rank's pid and collect the dumps written after it (waiting
    up to ``wait`` seconds in all): (the dumps by rank, the ranks signalled)."""
    asked_at = time.time()
    asked: list[int] = []
    for rank, pid in pids.items():
        try:
            os.kill(pid, signal.SIGURG)
            asked.append(rank)
        except OSError:  # it is gone already
            continue
    got: dict[int, dict] = {}
    end = clock() + wait
    while asked and clock() < end:
        for rank in list(asked):
            data = read_dump(folder, rank)
            if data is not None and float(data.get("time") or 0) >= asked_at - 0.01:
                got[rank] = data
                asked.remove(rank)
        if asked:
            time.sleep(0.02)
    return got, set(got) | set(asked)


def report(records_flight: Mapping[int, dict | None], asked: Mapping[int, dict],
           world: int, folder: str | None, cwd: str | None,
           signalled: Iterable[int] = ()) -> list[str]:
    """The diagnosis from the failure records' summaries and the dumps of the ranks asked
    (a dump is newer, so it wins); the dump files' paths are named. A rank signalled that
    wrote no dump is shown at the frame of its C-level stacks (``faulthandler``'s)."""
    flights: dict[int, dict | None] = dict(records_flight)
    at: dict[int, dict | None] = {}
    for rank, data in asked.items():
        flights[rank] = data
        at[rank] = data.get("at")
    unanswered = sorted(set(signalled) - set(asked))
    if folder:
        for rank in unanswered:
            at[rank] = read_stacks_frame(folder, rank)
    dumps = sorted({p for f in flights.values() if isinstance(f, dict)
                    for p in [f.get("dump")] if isinstance(p, str)}
                   | {os.path.join(folder, f"rank{r}.json") for r in asked if folder})
    return diagnose(flights, world, at=at, cwd=cwd, dumps=dumps, unanswered=unanswered)


def tidy(folder: str) -> None:
    """After the job's ranks on this host ended: remove their markers and empty stacks
    files (a rank that was killed could not), and the folder when nothing else is left;
    the dumps stay for the user."""
    if not (private(folder) and private(os.path.dirname(folder))):
        return
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        try:
            if name.endswith(".pid") or (name.endswith(".stacks.txt")
                                         and os.path.getsize(path) == 0):
                os.unlink(path)
        except OSError:
            continue
    try:
        os.rmdir(folder)
    except OSError:
        pass  # dumps are there


# ------------------------------------------------------------------ ddlrun --diagnose
def live_ranks(folder: str) -> dict[int, int]:
    """The ranks of the job folder whose process is alive: rank -> pid."""
    out = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    for name in names:
        if not (name.startswith("rank") and name.endswith(".pid")):
            continue
        try:
            rank = int(name[4:-4])
            with open(os.path.join(folder, name), encoding="ascii") as f:
                pid = int(f.read().strip())
            os.kill(pid, 0)
        except (ValueError, OSError):
            continue
        out[rank] = pid
    return out


def find_job(job: str | None) -> str:
    """The folder of ``job``; without one, the only job on this host with live ranks."""
    base = flight_base()
    if os.path.lexists(base) and not private(base):
        raise LaunchError(f"--diagnose: {base} is not a private folder of this user: not "
                          "trusting the pids it names")
    if job:
        if os.sep in job or job in (".", ".."):
            raise LaunchError(f"--diagnose: {job!r} is not a job id")
        folder = flight_folder(job)
        if not private(folder):
            raise LaunchError(f"--diagnose: no job {job!r} on this host (no {folder})")
        return folder
    try:
        jobs = sorted(os.listdir(base))
    except OSError:
        jobs = []
    live = [j for j in jobs if live_ranks(os.path.join(base, j))]
    if len(live) != 1:
        found = ", ".join(live) if live else "none"
        raise LaunchError(f"--diagnose: name the job (jobs with live ranks on this host: "
                          f"{found})")
    return os.path.join(base, live[0])


def pyspy_stacks(pid: int) -> str | None:
    """py-spy's dump of ``pid`` (None without py-spy, or when it could not read it)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True,
                             text=True, timeout=PYSPY_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def diagnose_job(job: str | None, note: Callable[[str], None], wait: float = 5.0,
                 cwd: str | None = None) -> int:
    """``ddlrun --diagnose``: ask the job's live ranks on this host, print each one's
    stacks (py-spy's, or the dump's) and the diagnosis. Exit code 0, or 1 when no rank
    answered."""
    folder = find_job(job)
    pids = live_ranks(folder)
    if not pids:
        raise LaunchError(f"--diagnose: no live rank of job {os.path.basename(folder)} "
                          "on this host")
    got, signalled = ask(pids, folder, wait)
    for rank in sorted(pids):
        text = pyspy_stacks(pids[rank])
        source = "py-spy"
        if text is None and rank in got:
            text = "".join(_main_first(got[rank].get("stacks") or {}))
            source = "its own dump"
        note(f"rank {rank} (pid {pids[rank]}), stacks from {source}:" if text else
             f"rank {rank} (pid {pids[rank]}) did not answer within {wait:g} s "
             f"(C-level stacks, if any: {os.path.join(folder, f'rank{rank}.stacks.txt')})")
        for line in (text or "").rstrip().splitlines():
            note(f"  | {line}")
    world = max(pids) + 1
    for line in report({}, got, world, folder, cwd, signalled):
        note(line)
    return 0 if got else 1


def _main_first(stacks: Mapping[str, Iterable[str]]) -> list[str]:
    out = []
    for name in sorted(stacks, key=lambda n: n != "MainThread"):
        out.append(f"Thread {name}:\n")
        out.extend(stacks[name])
    return out
