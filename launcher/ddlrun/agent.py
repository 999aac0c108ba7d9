"""Per-host agent: ``python -m ddlrun.agent``.

The launcher starts one agent per host (over ssh or blaunch) and writes the host's job
spec as one JSON line to the agent's stdin; nothing of it goes on a command line. The
agent starts the host's ranks, streams their output back as JSON lines on stdout, reports
every exit, and tears the ranks down (SIGTERM, deadline, SIGKILL) when

- the launcher writes ``{"t": "stop"}`` or its stdin ends (launcher gone, connection
  dropped),
- the agent gets SIGTERM, SIGINT or SIGHUP,
- one of its ranks fails (fail fast: the launcher stops the other hosts).

Before that teardown it reports which of its ranks are stopped (``stuck``), since the
teardown continues them. Then it removes the job's shared memory on this host
(``cleanup_job(job, host_index)``) and sends ``{"t": "done"}``. At start it removes
shared memory that crashed jobs of this user left on the host (``swept``).

Messages to the launcher: ``started {pids}``, ``swept {n, bytes}``, ``line {r, s, d}``,
``exit {r, c, p, w}`` (``w``: the wall-clock time of the exit, so the launcher can order
exits of all hosts by when they happened), ``eof {r}`` (all of rank r's output was sent),
``stuck {s: {rank: [pid, state]}}`` (on request ``{"t": "stuck"}`` and before teardown),
``done {removed}``. ``--probe`` prints host facts for preflight instead.
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

from .procs import Exit, ProcessSet, ProcSpec
from .shm import cleanup, sweep_orphans


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
    ranks = spec["ranks"]
    grace = float(spec.get("grace", 5.0))

    def on_line(rank: int, stream: str, text: str) -> None:
        writer.send(t="line", r=rank, s=stream, d=text)

    def on_exit(ex: Exit) -> None:
        exits[ex.key] = ex.code
        wall = time.time() - (time.monotonic() - ex.time)
        writer.send(t="exit", r=ex.key, c=ex.code, p=ex.pid, w=wall)
        if ex.code != 0:
            failed.set()
        if len(exits) == len(ranks) or ex.code != 0:
            stop.set()

    def on_eof(rank: int) -> None:
        writer.send(t="eof", r=rank)

    def send_stuck() -> None:
        writer.send(t="stuck", s={str(k): list(v) for k, v in procs.stuck().items()})

    def watch_stdin() -> None:
        for raw in iter(stdin.readline, b""):
            try:
                kind = json.loads(raw).get("t")
            except (ValueError, AttributeError):
                continue
            if kind == "stop":
                break
            if kind == "stuck":
                send_stuck()
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
    procs = ProcessSet(on_line, on_exit, on_eof=on_eof)
    try:
        procs.start(
            ProcSpec(r["rank"], tuple(r["argv"]), {**base, **r["env"]}, cwd) for r in ranks
        )
    except OSError as exc:
        writer.send(t="error", m=f"cannot start {ranks[0]['argv'][0]!r}: {exc.strerror}")
        procs.close(timeout=grace)
        cleanup(spec["job_id"], spec["host_index"])
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
        removed = cleanup(spec["job_id"], spec["host_index"])
        writer.send(t="done", removed=len(removed))
    return 1 if failed.is_set() else 0


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
    # Unbuffered: the thread that waits on stdin must hold no buffer lock, or interpreter
    # shutdown aborts the agent ("could not acquire lock for <stdin>"); messages are small.
    stdin = io.FileIO(sys.stdin.fileno(), "rb", closefd=False)
    line = stdin.readline()
    if not line:
        return 2
    return run_agent(json.loads(line), stdin, sys.stdout.buffer)


if __name__ == "__main__":
    raise SystemExit(main())
