"""Per-host agent: ``python -m ddlrun.agent``.

The launcher starts one agent per host (over ssh or blaunch) and writes the host's job
spec as one JSON line to the agent's stdin; nothing of it goes on a command line. The
agent starts the host's ranks, streams their output back as JSON lines on stdout, reports
every exit, and tears the ranks down (SIGTERM, deadline, SIGKILL) when

- the launcher writes ``{"t": "stop"}`` or its stdin ends (launcher gone, connection
  dropped),
- the agent gets SIGTERM, SIGINT or SIGHUP,
- one of its ranks fails (fail fast: the launcher stops the other hosts), unless the spec
  says ``"elastic": true`` (an elastic job's workers: the others go on, and the agent ends
  when all its ranks have exited).

Before that teardown it reports which of its ranks are stopped (``stuck``), since the
teardown continues them. The teardown also ends, by pid, what the ranks left running in
sessions of their own (the agent is their child subreaper: reaper.py), even after ranks
that all exited 0. Then it removes the job's shared memory on this host
(``cleanup_job(job, host_index)``) and sends ``{"t": "done"}``. At start it removes
shared memory that crashed jobs of this user left on the host (``swept``).

Each rank gets a ``DDL_ERROR_FILE`` in a private folder of the job on this host (0700,
removed at the end): the failure record it writes there when an exception ends it travels
back with its exit (failures.py).

Messages to the launcher: ``started {pids}``, ``swept {n, bytes}``, ``line {r, s, d}``,
``exit {r, c, p, w, e}`` (``w``: the wall-clock time of the exit, so the launcher can order
exits of all hosts by when they happened; ``e``: the rank's failure record, when it failed
and wrote one), ``eof {r}`` (all of rank r's output was sent),
``stuck {s: {rank: [pid, state, starting]}}`` (on request ``{"t": "stuck"}`` and before
teardown; ``starting``: stopped before its program was exec'd), ``error {m}`` (a rank's
program could not be exec'd: the agent stops and exits 127), ``done {removed}``.
``--probe`` prints host facts for preflight instead.

Messages from the launcher: ``stop``, ``stuck``, and for an elastic job ``jobs {jobs}``
(the job ids of its later worlds, whose shared memory the agent removes at its end too).

Nothing waits on a rank's start: ``started`` comes as soon as every rank is forked, and the
agent answers ``stuck`` and ``stop`` from then on, even for a rank stopped before its exec.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import threading
import time
from typing import BinaryIO

from . import envs
from .diagnose import flight_folder, tidy
from .failures import RecordFolder, read_record
from .procs import Exit, ProcessSet, ProcSpec
from .reaper import become_subreaper
from .shm import cleanup, job_secret, sweep_orphans


class _Writer:
    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    def send(self, **msg) -> None:
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self._lock:
            try:
                self._out.write(data)
                self._out.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass


def run_agent(spec: dict, stdin: BinaryIO, stdout: BinaryIO) -> int:
    writer = _Writer(stdout)
    stop = threading.Event()
    exits: dict[int, int] = {}
    failed = threading.Event()
    start_error: list[str] = []  # the first rank program that could not be exec'd
    ranks = spec["ranks"]
    grace = float(spec.get("grace", 5.0))
    elastic = bool(spec.get("elastic"))
    jobs = [str(spec["job_id"])]  # an elastic job's later worlds are named by {"t": "jobs"}
    records = RecordFolder(str(spec["job_id"]))

    def on_line(rank: int, stream: str, text: str) -> None:
        writer.send(t="line", r=rank, s=stream, d=text)

    def on_exit(ex: Exit) -> None:
        if ex.error is not None:  # its program could not be exec'd: nothing of it ran
            if not start_error:
                start_error.append(f"cannot start {ex.error.filename!r}: {ex.error.strerror}")
                writer.send(t="error", m=start_error[0])
            stop.set()
            return
        exits[ex.key] = ex.code
        wall = time.time() - (time.monotonic() - ex.time)
        record = read_record(env_of[ex.key][envs.DDL_ERROR_FILE]) if ex.code != 0 else None
        if record is None:
            writer.send(t="exit", r=ex.key, c=ex.code, p=ex.pid, w=wall)
        else:
            writer.send(t="exit", r=ex.key, c=ex.code, p=ex.pid, w=wall, e=record.to_json())
        if ex.code != 0:
            failed.set()
        if len(exits) == len(ranks) or (ex.code != 0 and not elastic):
            stop.set()

    def on_eof(rank: int) -> None:
        writer.send(t="eof", r=rank)

    def send_stuck() -> None:
        writer.send(t="stuck", s={str(k): list(v) for k, v in procs.stuck().items()})

    def watch_stdin() -> None:
        for raw in iter(stdin.readline, b""):
            try:
                msg = json.loads(raw)
                kind = msg.get("t")
            except (ValueError, AttributeError):
                continue
            if kind == "stop":
                break
            if kind == "stuck":
                send_stuck()
            if kind == "jobs":  # an elastic job's new world: its segments are cleaned too
                jobs.extend(str(j) for j in msg.get("jobs", ()) if str(j) not in jobs)
        stop.set()

    def on_signal(signum, frame) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    cwd = spec.get("cwd")
    if not cwd or not os.path.isdir(cwd):
        cwd = None
    base = dict(os.environ)
    swept = sweep_orphans()
    if swept:
        writer.send(t="swept", n=len(swept), bytes=sum(size for _, size in swept))
    # the rank's env from the spec (-x) may name its own record file
    flight = flight_folder(str(spec["job_id"]))
    env_of = {r["rank"]: {**base, envs.DDL_ERROR_FILE: records.path(r["rank"]),
                          envs.DDL_FLIGHT_DIR: flight, **r["env"]}
              for r in ranks}
    # an agent with no ranks only removes what the job left here (a lost host's segments)
    secret = job_secret(ranks[0]["env"] if ranks else spec.get("env", {}))
    procs = ProcessSet(on_line, on_exit, on_eof=on_eof)
    try:
        procs.start(
            ProcSpec(r["rank"], tuple(r["argv"]), env_of[r["rank"]], cwd) for r in ranks
        )
    except OSError as exc:
        writer.send(t="error", m=f"cannot start {ranks[0]['argv'][0]!r}: {exc.strerror}")
        procs.close(timeout=grace)
        records.remove()
        cleanup(spec["job_id"], spec["host_index"], secret)
        writer.send(t="done", removed=0)
        return 127
    writer.send(t="started", pids={str(k): p.pid for k, p in procs.procs.items()})
    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        send_stuck()
        procs.close(signal.SIGTERM, grace)
        records.remove()
        tidy(flight)
        removed = cleanup(spec["job_id"], None if elastic else spec["host_index"], secret)
        for job in jobs[1:]:  # an elastic job's worlds: every host index this host had
            tidy(flight_folder(job))
            removed += cleanup(job, None, secret)
        writer.send(t="done", removed=len(removed))
    return 127 if start_error else 1 if failed.is_set() else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddlrun.agent", description=__doc__.split("\n")[0])
    p.add_argument("--probe", action="store_true", help="print this host's facts as JSON")
    p.add_argument("--port", type=int, action="append", default=[],
                   help="with --probe: check this port (repeatable)")
    p.add_argument("--iface", default=None, help="with --probe: report this interface's address")
    p.add_argument("--python", default=None,
                   help="with --probe: check that this interpreter can import ddl")
    args = p.parse_args(argv)
    if args.probe:
        from .preflight import probe

        print(json.dumps(probe(args.port, args.iface, args.python)), flush=True)
        return 0
    become_subreaper()  # before any fork: the ranks' orphans come to us (reaper.py)
    # Unbuffered: the thread that waits on stdin must hold no buffer lock, or interpreter
    # shutdown aborts the agent ("could not acquire lock for <stdin>"); messages are small.
    stdin = io.FileIO(sys.stdin.fileno(), "rb", closefd=False)
    line = stdin.readline()
    if not line:
        return 2
    return run_agent(json.loads(line), stdin, sys.stdout.buffer)


if __name__ == "__main__":
    raise SystemExit(main())
