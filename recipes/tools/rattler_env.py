"""py-rattler on a local channel: index it, solve from it, install into a fresh prefix, run there.

Used by ``make conda`` and tests/conda/test_conda.py around rattler-build (which builds and
runs the recipes' own tests): ``index_channel`` (py-rattler ``index_fs``), ``solve``
(``rattler.solve`` with explicit virtual packages, ``__cuda`` only when asked for),
``create_env`` (solve + ``rattler.install`` from the ``file://`` channel) and
``run_in_prefix`` / ``acceptance_tests`` (recipes/tests.yaml, each command run with bash, the
prefix's bin/ first on PATH).

py-rattler's runtime threads can crash the interpreter while it finalizes (a Fatal Python
error "PyGILState_Release ... finalizing", about 1 exit in 5 with py-rattler 0.28). So every
rattler call runs in a child process (this file, subcommand ``call``) that ends with os._exit
once its answer is written: the crash cannot reach the caller (a pytest run, make).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class SolveError(RuntimeError):
    """The local channel cannot satisfy the specs; the message is the solver's explanation."""


def this_subdir() -> str:
    """conda's name for this machine's platform (linux-64, linux-aarch64, osx-arm64, ...)."""
    osname = {"linux": "linux", "darwin": "osx", "win32": "win"}.get(sys.platform, "linux")
    arch = {"x86_64": "64", "AMD64": "64"}.get(platform.machine(), platform.machine())
    return f"{osname}-{arch}"


def _call(request: dict[str, Any]) -> Any:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "call"],
                          input=json.dumps(request), capture_output=True, text=True, timeout=300)
    try:
        answer = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"rattler {request['op']} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}") from None
    if answer.get("solver_error"):
        raise SolveError(answer["solver_error"])
    if "error" in answer:
        raise RuntimeError(f"rattler {request['op']}: {answer['error']}")
    return answer["result"]


def virtual_packages(cuda: str | None = None) -> list[Any]:
    """Explicit virtual packages: this machine's, plus ``__cuda`` only when asked for."""
    from rattler import BuildString, GenericVirtualPackage, PackageName, Version

    libc = platform.libc_ver()[1] or "2.17"
    pkgs = [("__unix", "0", "0"), ("__linux", platform.release().split("-")[0], "0"),
            ("__glibc", libc, "0"), ("__archspec", "1", platform.machine())]
    if cuda:
        pkgs.append(("__cuda", cuda, "0"))
    return [GenericVirtualPackage(PackageName(n), Version(v), BuildString(b))
            for n, v, b in pkgs]


def _child(request: dict[str, Any]) -> Any:
    import rattler
    from rattler.exceptions import SolverError
    from rattler.index import index_fs

    if request["op"] == "index":
        asyncio.run(index_fs(Path(request["channel"]), force=True))
        return None
    try:
        records = asyncio.run(rattler.solve(
            [rattler.Channel(Path(request["channel"]).resolve().as_uri())], request["specs"],
            platforms=[request["subdir"], "noarch"],
            virtual_packages=virtual_packages(request.get("cuda"))))
    except SolverError as exc:
        return {"solver_error": str(exc)}
    if request["op"] == "create":
        asyncio.run(rattler.install(records, Path(request["prefix"]),
                                    cache_dir=Path(request["cache"]), show_progress=False))
    return [{"name": r.name.normalized, "version": str(r.version), "build": str(r.build),
             "build_number": r.build_number, "subdir": r.subdir, "depends": list(r.depends)}
            for r in records]


def index_channel(channel: Path) -> None:
    """repodata.json for every subdir of a local channel (py-rattler ``index_fs``)."""
    for subdir in ("noarch", this_subdir()):  # conda wants both, even if one is empty
        (channel / subdir).mkdir(parents=True, exist_ok=True)
    _call({"op": "index", "channel": str(channel)})


def solve(channel: Path, specs: Sequence[str], cuda: str | None = None,
          subdir: str | None = None) -> list[dict[str, Any]]:
    """The records ``rattler.solve`` picks from the local channel (dicts: name, build, ...)."""
    return _call({"op": "solve", "channel": str(channel), "specs": list(specs),
                  "cuda": cuda, "subdir": subdir or this_subdir()})


def create_env(channel: Path, specs: Sequence[str], prefix: Path, cache: Path,
               cuda: str | None = None) -> list[dict[str, Any]]:
    """Solve ``specs`` from the local channel and install them into a fresh ``prefix``."""
    return _call({"op": "create", "channel": str(channel), "specs": list(specs),
                  "cuda": cuda, "subdir": this_subdir(), "prefix": str(prefix),
                  "cache": str(cache)})


@dataclass(frozen=True)
class EnvTest:
    """One acceptance test: a name and a bash command."""

    name: str
    command: str


def acceptance_tests(path: Path) -> list[EnvTest]:
    """recipes/tests.yaml (Open-CE style: ``tests: [{name, command}]``)."""
    data = yaml.safe_load(path.read_text()) or {}
    return [EnvTest(t["name"], t["command"]) for t in data["tests"]]


def env_for(prefix: Path) -> dict[str, str]:
    """This environment with ``prefix`` activated (bin/ first, no venv or PYTHON* leaking in)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CONDA_PREFIX")}
    env.update(PATH=f"{prefix / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin",
               CONDA_PREFIX=str(prefix), PREFIX=str(prefix), PYTHONNOUSERSITE="1")
    return env


def run_in_prefix(tests: Sequence[EnvTest], prefix: Path, cwd: Path, timeout: float = 120
                  ) -> list[tuple[EnvTest, subprocess.CompletedProcess]]:
    """Run each test inside ``prefix``; return the failures (test, completed process)."""
    failures = []
    for test in tests:
        proc = subprocess.run(["bash", "-e", "-c", test.command], cwd=cwd, env=env_for(prefix),
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            failures.append((test, proc))
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rattler_env.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("call", help="internal: one py-rattler call, JSON on stdin and stdout")
    i = sub.add_parser("index", help="index a local channel")
    i.add_argument("channel")
    args = p.parse_args(argv)
    if args.cmd == "index":
        index_channel(Path(args.channel).resolve())
        return 0
    try:
        answer = {"result": _child(json.loads(sys.stdin.read()))}
        if isinstance(answer["result"], dict):
            answer = answer["result"]
    except Exception as exc:  # reported to the parent, which raises it
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalization: see the docstring


if __name__ == "__main__":
    sys.exit(main())
