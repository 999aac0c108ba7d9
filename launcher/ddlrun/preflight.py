"""Preflight: is every host reachable, on the same versions, and are the ports the job will
bind free on host 0 (MASTER_PORT, which torch's ``init_process_group`` binds, and ddl's
store port, ``DDL_PORT`` or MASTER_PORT+1)?

``probe()`` runs on a host (in-process for local jobs, ``python -m ddlrun.agent --probe``
over ssh for remote ones) and returns facts as JSON. ``check()`` is pure: facts in,
problems (one clear line each) and a table out. The commands a preflight runs go through
one ``ProbeRuns``, so an interrupted preflight (Ctrl-C) kills those still running.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import os
import platform
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata

from .plan import HostFacts

VERSION_KEYS = ("powerddl", "python", "torch")


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def count_gpus(run=subprocess.run) -> int:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return 0
    try:
        out = run([exe, "-L"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for ln in out.stdout.splitlines() if ln.startswith("GPU "))


def interface_address(name: str) -> str | None:
    """IPv4 address of a network interface (SIOCGIFADDR), None if absent/unconfigured."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = struct.pack("256s", name.encode()[:15])
            res = fcntl.ioctl(s.fileno(), 0x8915, packed)  # SIOCGIFADDR
            return socket.inet_ntoa(res[20:24])
    except OSError:
        return None


def port_free(port: int, addr: str = "") -> bool:
    """Whether a listener can bind ``port`` now, the way ddl's store (and torch's TCPStore)
    will: with SO_REUSEADDR, so a port whose last job's connections linger in TIME_WAIT (a
    minute after a rerun with the same --master-port) is free, one a process listens on
    is not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
            return True
        except OSError:
            return False


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def pick_free_pair(avoid: Sequence[int] = (), attempts: int = 500) -> int:
    """A port P with P and P+1 both free: the job binds MASTER_PORT and ddl's store binds
    MASTER_PORT+1 (unless DDL_PORT says otherwise). Drawn at random below the ephemeral
    range: a port the kernel handed out would soon be some connection's source port, and
    P+1 could be anybody's. ``avoid``: ports already given to another job of this run."""
    top = _ephemeral_low() - 2
    rng = random.Random()
    for _ in range(attempts):
        p = rng.randrange(max(1024, top - 12000), top)
        if any(abs(p - q) <= 1 for q in avoid):
            continue
        if port_free(p) and port_free(p + 1):
            return p
    raise OSError(f"no free pair of ports in {max(1024, top - 12000)}-{top} "
                  f"after {attempts} tries")


class ProbeRuns:
    """``subprocess.run`` for a preflight's commands (the ``run`` seam of ``probe_remote``,
    ``python_problem`` and ``count_gpus``) that remembers each running child: ``kill()``
    ends them all, so an interrupted preflight leaves no ssh session behind, and any run
    after it fails at once. Each child has its own session; ``kill()`` signals its process
    group (ssh's ProxyCommand too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self._killed = False

    def run(self, argv: Sequence[str], *, capture_output: bool = False, text: bool = False,
            timeout: float | None = None, stdin=subprocess.DEVNULL
            ) -> subprocess.CompletedProcess:
        pipe = subprocess.PIPE if capture_output else None
        with self._lock:
            if self._killed:
                raise OSError(f"{argv[0]}: the preflight was stopped")
            proc = subprocess.Popen(list(argv), stdout=pipe, stderr=pipe, stdin=stdin,
                                    text=text, start_new_session=True)
            self._running.add(proc)
        try:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._kill(proc)
                proc.communicate()
                raise
        finally:
            with self._lock:
                self._running.discard(proc)
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)

    def kill(self) -> None:
        with self._lock:
            self._killed = True
            running = list(self._running)
        for proc in running:
            self._kill(proc)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.returncode is None:  # not reaped: its pid is still its own group's id
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def python_problem(python: str, run=subprocess.run) -> str | None:
    """One line when ``python`` (the program's interpreter) cannot import ddl here."""
    exe = shutil.which(python) or python
    try:
        out = run([exe, "-c", "import ddl"], capture_output=True, text=True, timeout=60,
                  stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run the program's interpreter {python!r}: {exc}"
    if out.returncode == 0:
        return None
    where = f" ({exe})" if exe != python else ""
    return (f"the program's interpreter {python!r}{where} cannot import ddl: run the program "
            f"with {sys.executable} (the python ddlrun runs with) or install powerddl for "
            "that interpreter")


def probe(ports: Sequence[int] = (), iface: str | None = None,
          python: str | None = None, run=subprocess.run) -> dict:
    """Facts about this host, as a JSON-able dict; with ``python``, whether that interpreter
    (the program's) can import ddl here. ``run`` runs the commands (``ProbeRuns.run``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    facts = {
        "hostname": socket.gethostname(),
        "cores": cores,
        "gpus": count_gpus(run),
        "versions": {
            "powerddl": _dist_version("powerddl"),
            "python": platform.python_version(),
            "torch": _dist_version("torch"),
        },
        "iface": iface,
        "address": interface_address(iface) if iface else None,
    }
    facts["ports"] = {str(p): port_free(p) for p in ports}
    if python:
        facts["python_problem"] = python_problem(python, run)
    # None: no free pair here; choosing the port then says so (steps.choose_port)
    facts["free_port"] = None
    with contextlib.suppress(OSError):
        facts["free_port"] = pick_free_pair()
    return facts


def facts_from_probe(d: Mapping) -> HostFacts:
    return HostFacts(
        cores=int(d.get("cores", 1)),
        gpus=int(d.get("gpus", 0)),
        address=d.get("address"),
        hostname=str(d.get("hostname", "")),
        versions=tuple(sorted((str(k), str(v)) for k, v in dict(d.get("versions", {})).items())),
        free_port=int(d["free_port"]) if d.get("free_port") else None,
    )


@dataclass(frozen=True)
class ProbeResult:
    host: str
    data: dict | None
    error: str | None


def probe_remote(
    host: str, argv: Sequence[str], timeout: float, fix: str, run=subprocess.run
) -> ProbeResult:
    """Run a probe command (``ssh ... host python -m ddlrun.agent --probe``)."""
    try:
        out = run(list(argv), capture_output=True, text=True, timeout=timeout,
                  stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return ProbeResult(host, None, f"{host}: no answer within --start-timeout {timeout:g}s"
                           f" ({fix})")
    except OSError as exc:
        return ProbeResult(host, None, f"{host}: cannot run {argv[0]!r}: {exc.strerror}")
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        return ProbeResult(host, None, f"{host}: unreachable (exit {out.returncode}: {last}) "
                                       f"({fix})")
    for line in reversed(out.stdout.splitlines()):
        with contextlib.suppress(ValueError):
            data = json.loads(line)
            if isinstance(data, dict):
                return ProbeResult(host, data, None)
    return ProbeResult(host, None, f"{host}: probe printed no result; is powerddl installed "
                                   "for that python there? (see --remote-python)")


def probe_all(
    hosts: Sequence[str], probe_one: Callable[[str], ProbeResult], parallel: int = 32,
    stop: Callable[[], None] | None = None,
) -> list[ProbeResult]:
    """``probe_one`` of every host, ``parallel`` at a time. When the wait is interrupted
    (a signal raised in the main thread), ``stop()`` ends the probes still running
    (``ProbeRuns.kill``) before the threads are joined and the exception goes on."""
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=min(parallel, len(hosts) or 1))
    try:
        return list(ex.map(probe_one, hosts))
    except BaseException:
        if stop is not None:
            stop()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def version_table(results: Sequence[ProbeResult]) -> str:
    header = ["host", "hostname", *VERSION_KEYS, "cores", "gpus"]
    rows = [header]
    for r in results:
        if r.data is None:
            rows.append([r.host, "(unreachable)", *["-"] * (len(header) - 2)])
            continue
        v = r.data.get("versions", {})
        rows.append([r.host, str(r.data.get("hostname", "")),
                     *[str(v.get(k, "-")) for k in VERSION_KEYS],
                     str(r.data.get("cores", "")), str(r.data.get("gpus", ""))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def check(
    results: Sequence[ProbeResult],
    iface: str | None = None,
    port_names: Mapping[int, str] | None = None,
) -> list[str]:
    """Problems, one line each (empty: all good). The first host binds the job's ports;
    ``port_names`` says what each checked port is for."""
    problems = [r.error for r in results if r.error]
    ok = [r for r in results if r.data is not None]
    for r in ok:
        if r.data.get("python_problem"):
            problems.append(f"{r.host}: {r.data['python_problem']}")
    for key in VERSION_KEYS:
        seen: dict[str, list[str]] = {}
        for r in ok:
            seen.setdefault(str(r.data.get("versions", {}).get(key, "-")), []).append(r.host)
        if len(seen) > 1:
            parts = "; ".join(f"{v} on {', '.join(h)}" for v, h in sorted(seen.items()))
            problems.append(f"{key} version differs between hosts: {parts} "
                            "(install the same powerddl environment on every host)")
    if iface:
        for r in ok:
            if not r.data.get("address"):
                problems.append(f"{r.host}: network interface {iface!r} not found or has no "
                                "IPv4 address (check --network-interface; `ip addr` lists them)")
    if results and results[0].data is not None:
        for port, free in sorted(dict(results[0].data.get("ports", {})).items()):
            if not free:
                what = (port_names or {}).get(int(port), f"port {port}")
                problems.append(f"{results[0].host}: {what} is in use; choose another "
                                "--master-port (or DDL_PORT for the store)")
    return problems
