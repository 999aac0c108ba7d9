"""Build, index, install and test conda packages without conda-build (``make conda`` fallback).

What it does, step by step, for a rendered recipe (recipes/tools/render.py):

- ``build_recipe``: copies the recipe's ``source: path:`` (git's tracked and untracked,
  not-ignored files) into a work directory, runs the recipe's own ``build: script`` there with
  bash, with ``PIP_PREFIX`` pointing pip at a staging prefix, then lays the staged files out as
  conda-build does for ``noarch: python`` (``site-packages/``, ``python-scripts/``, entry
  points only in ``info/link.json``, no ``.pyc``) and writes ``info/index.json``,
  ``info/paths.json``, ``info/files``, ``info/link.json``, ``info/about.json`` and
  ``info/recipe/meta.yaml`` (the rendered recipe), then ``.conda`` (conda-package-handling,
  zstd level 3).
- ``wheel_to_conda``: a PyPI wheel as a conda package (pure wheels: noarch python; others:
  the platform subdir, files under ``lib/pythonX.Y/site-packages``), depends converted from
  Requires-Dist (markers evaluated for this interpreter, extras dropped).
- ``stub_python``: a ``python`` package that reuses this machine's interpreter: ``bin/python*``
  are symlinks to it and ``pyvenv.cfg`` makes the prefix its ``sys.prefix`` (a venv in conda
  clothes). It is not a conda-forge python: the stdlib is the machine's.
- ``index_channel`` (py-rattler ``index_fs``), ``create_env`` (``rattler.solve`` +
  ``rattler.install`` from the ``file://`` channel, explicit virtual packages).
- ``recipe_tests`` / ``acceptance_tests`` / ``run_tests``: the recipe's ``test:`` section
  (imports, commands) and recipes/tests.yaml, each run inside a prefix with its own PATH.

Not exercised: real conda-build (its environment isolation, host/build env solving, prefix
replacement, run_exports, its pyc and entry-point handling at build time), compilers, solving
against conda-forge, and python itself as a conda package.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render  # noqa: E402  (a sibling module, also run as a script)

PY_VER = f"{sys.version_info.major}.{sys.version_info.minor}"
SP_DIR = f"lib/python{PY_VER}/site-packages"


def this_subdir() -> str:
    return render.platform_namespace()["subdir"]


# --- package files ------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _payload(root: Path) -> list[str]:
    """Every file and symlink under root, relative, sorted, info/ excluded."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("info/") or (path.is_dir() and not path.is_symlink()):
            continue
        out.append(rel)
    return out


def write_package(root: Path, index: dict[str, Any], out_dir: Path, *,
                  link: dict[str, Any] | None = None, about: dict[str, Any] | None = None,
                  recipe_text: str | None = None) -> Path:
    """Write info/ for the payload already under ``root`` and pack ``<dist>.conda``."""
    from conda_package_handling import api

    info = root / "info"
    info.mkdir(parents=True, exist_ok=True)
    files = _payload(root)
    paths = []
    for rel in files:
        path = root / rel
        if path.is_symlink():
            paths.append({"_path": rel, "path_type": "softlink", "size_in_bytes": 0})
        else:
            paths.append({"_path": rel, "path_type": "hardlink", "sha256": _sha256(path),
                          "size_in_bytes": path.stat().st_size})
    index = {"timestamp": int(time.time() * 1000), **index}
    (info / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (info / "paths.json").write_text(json.dumps({"paths": paths, "paths_version": 1}, indent=2))
    (info / "files").write_text("".join(f"{rel}\n" for rel in files))
    if link is not None:
        (info / "link.json").write_text(json.dumps(link, indent=2))
    if about is not None:
        (info / "about.json").write_text(json.dumps(about, indent=2, sort_keys=True))
    if recipe_text is not None:
        (info / "recipe").mkdir(exist_ok=True)
        (info / "recipe" / "meta.yaml").write_text(recipe_text)
    subdir = out_dir / index["subdir"]
    subdir.mkdir(parents=True, exist_ok=True)
    name = f"{index['name']}-{index['version']}-{index['build']}.conda"
    all_files = files + [p.relative_to(root).as_posix() for p in sorted(info.rglob("*"))
                         if p.is_file()]
    api.create(str(root), all_files, name, str(subdir), compression_level=3)
    return subdir / name


def _noarch_python_layout(stage: Path, root: Path, entry_points: Iterable[str]) -> None:
    """conda-build's noarch python layout: site-packages/, python-scripts/, no .pyc."""
    scripts = {ep.split("=", 1)[0].strip() for ep in entry_points}
    site = stage / SP_DIR
    if site.is_dir():
        shutil.copytree(site, root / "site-packages", ignore=shutil.ignore_patterns(
            "__pycache__", "*.pyc"), symlinks=True)
    bindir = stage / "bin"
    if bindir.is_dir():
        for script in bindir.iterdir():
            if script.name in scripts:
                continue  # recreated at link time from info/link.json
            (root / "python-scripts").mkdir(exist_ok=True)
            shutil.copy2(script, root / "python-scripts" / script.name)
    for dist_info in (root / "site-packages").glob("*.dist-info"):
        (dist_info / "INSTALLER").write_text("conda\n")
        (dist_info / "direct_url.json").unlink(missing_ok=True)


# --- build a rendered recipe ----------------------------------------------------------------

def copy_source(src: Path, dest: Path) -> None:
    """The source tree as git sees it (tracked + untracked, not ignored), else everything."""
    try:
        out = subprocess.run(["git", "-C", str(src), "ls-files", "-co", "--exclude-standard", "-z"],
                             check=True, capture_output=True).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()
                 and not {".git", ".venv", "build"} & set(p.relative_to(src).parts)]
    for name in names:
        path = src / name
        if path.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / name)


def build_recipe(rendered: render.Rendered, out_dir: Path, work: Path,
                 python: str = sys.executable, log=None) -> Path:
    """Build one rendered ``noarch: python`` recipe into ``out_dir/noarch/<dist>.conda``."""
    if rendered.noarch != "python":
        raise render.RenderError(f"{rendered.recipe_dir}: only noarch: python recipes can be "
                                 "built here; use conda-build for the others")
    meta = rendered.meta
    src_rel = (meta.get("source") or {}).get("path", ".")
    src = (rendered.recipe_dir / src_rel).resolve()
    work_src, stage, root = work / "work", work / "stage", work / "pkg"
    for d in (work_src, stage, root):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    copy_source(src, work_src)
    script = rendered.build.get("script")
    if isinstance(script, list):
        script = "\n".join(script)
    if not script:
        raise render.RenderError(f"{rendered.recipe_dir}: build/script is empty")
    env = dict(os.environ, PREFIX=str(stage), SRC_DIR=str(work_src), PYTHON=python,
               RECIPE_DIR=str(rendered.recipe_dir), PKG_NAME=rendered.name,
               PKG_VERSION=rendered.version, PKG_BUILDNUM=str(rendered.build_number),
               SP_DIR=str(stage / SP_DIR), PY_VER=PY_VER, CONDA_BUILD="1",
               # pip --prefix alone still uninstalls the package from the interpreter's own
               # environment (conda-build's host prefix is a separate env; this is not):
               # --ignore-installed keeps the builder's environment untouched.
               PIP_PREFIX=str(stage), PIP_IGNORE_INSTALLED="1",
               PIP_NO_INDEX="1", PIP_NO_WARN_SCRIPT_LOCATION="1",
               PIP_ROOT_USER_ACTION="ignore", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["bash", "-e", "-c", script], cwd=work_src, env=env,
                          stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "" if log else proc.stdout[-4000:]
        raise RuntimeError(f"build script of {rendered.dist} failed ({proc.returncode}):\n{tail}")
    entry_points = [str(e) for e in rendered.build.get("entry_points") or []]
    _noarch_python_layout(stage, root, entry_points)
    about = dict(meta.get("about") or {})
    index = {"name": rendered.name, "version": rendered.version, "build": rendered.build_string,
             "build_number": rendered.build_number, "depends": rendered.requirements("run"),
             "constrains": rendered.requirements("run_constrained"), "noarch": "python",
             "subdir": "noarch", "license": about.get("license", "")}
    link = {"noarch": {"type": "python", "entry_points": entry_points},
            "package_metadata_version": 1}
    return write_package(root, index, out_dir, link=link, about=about,
                         recipe_text=rendered.text)


# --- wheels and the python stub ---------------------------------------------------------------

def conda_name(pypi_name: str) -> str:
    return pypi_name.lower().replace("_", "-").replace(".", "-")


def _conda_specifier(spec: str) -> str:
    """PEP 440 specifier set -> conda version spec (``~=`` spelled out)."""
    parts = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item.startswith("~="):
            version = item[2:].strip().split(".")
            upper = version[:-1]
            upper[-1] = str(int(upper[-1]) + 1)
            parts += [f">={'.'.join(version)}", f"<{'.'.join(upper)}.0a0"]
        elif item.startswith("==") and not item.startswith("==="):
            parts.append(item[2:].strip())
        else:
            parts.append(item.replace(" ", ""))
    return ",".join(parts)


def requires_to_depends(requires: Iterable[str]) -> list[str]:
    from packaging.requirements import Requirement

    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        spec = _conda_specifier(str(req.specifier))
        out.append(f"{conda_name(req.name)} {spec}".strip())
    return out


def wheel_to_conda(wheel: Path, out_dir: Path, work: Path) -> Path:
    """One wheel as a conda package: noarch python if pure, else this platform's subdir."""
    root = work / wheel.stem
    shutil.rmtree(root, ignore_errors=True)
    unpacked = root.with_suffix(".unpacked")
    shutil.rmtree(unpacked, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    dist_info = next(unpacked.glob("*.dist-info"))
    meta = Parser().parsestr((dist_info / "METADATA").read_text(encoding="utf-8"))
    wheel_meta = Parser().parsestr((dist_info / "WHEEL").read_text())
    pure = wheel_meta.get("Root-Is-Purelib", "").strip().lower() == "true" and \
        all(t.endswith("-none-any") for t in wheel_meta.get_all("Tag", []))
    site = root / ("site-packages" if pure else SP_DIR)
    site.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(unpacked, site, symlinks=True,
                    ignore=shutil.ignore_patterns("*.data", "__pycache__", "*.pyc"))
    for data in unpacked.glob("*.data"):
        for kind in ("purelib", "platlib"):
            if (data / kind).is_dir():
                shutil.copytree(data / kind, site, dirs_exist_ok=True)
    (site / dist_info.name / "INSTALLER").write_text("conda\n")
    entry_points = []
    eps = dist_info / "entry_points.txt"
    if eps.is_file():
        import configparser

        parser = configparser.ConfigParser(delimiters=("=",))
        parser.optionxform = str
        parser.read_string(eps.read_text())
        if parser.has_section("console_scripts"):
            entry_points = [f"{k} = {v}" for k, v in parser.items("console_scripts")]
    name, version = conda_name(meta["Name"]), meta["Version"]
    depends = requires_to_depends(meta.get_all("Requires-Dist", []))
    major, minor = sys.version_info[:2]
    if pure:
        index = {"noarch": "python", "subdir": "noarch", "build": "pyh_wheel_0",
                 "depends": [f"python {meta.get('Requires-Python', '').replace(' ', '')}"
                             .strip(), *depends]}
        link = {"noarch": {"type": "python", "entry_points": entry_points},
                "package_metadata_version": 1}
    else:  # console scripts of binary wheels are not generated (none is needed here)
        index = {"subdir": this_subdir(), "build": f"py{major}{minor}_wheel_0",
                 "depends": [f"python >={major}.{minor},<{major}.{minor + 1}.0a0", *depends]}
        link = None
    index.update(name=name, version=version, build_number=0,
                 license=meta.get("License-Expression") or meta.get("License") or "")
    return write_package(root, index, out_dir, link=link)


def stub_python(out_dir: Path, work: Path, interpreter: str | None = None) -> Path:
    """``python`` = this machine's interpreter, symlinked, with a pyvenv.cfg (see the docstring)."""
    base = Path(interpreter or getattr(sys, "_base_executable", sys.executable)).resolve()
    root = work / "python-stub"
    shutil.rmtree(root, ignore_errors=True)
    (root / "bin").mkdir(parents=True)
    exe = f"python{PY_VER}"
    (root / "bin" / exe).symlink_to(base)
    for alias in ("python", "python3"):
        (root / "bin" / alias).symlink_to(exe)
    (root / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n"
                                     f"version = {platform.python_version()}\n")
    index = {"name": "python", "version": platform.python_version(), "build": "0_machine_stub",
             "build_number": 0, "depends": [], "subdir": this_subdir(),
             "license": "PSF-2.0"}
    return write_package(root, index, out_dir)


def download_wheels(requirements: Sequence[str], dest: Path,
                    python: str = sys.executable) -> list[Path]:
    """``pip download`` the wheels (with their dependencies) for this interpreter."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "pip", "download", "--only-binary=:all:", "-q",
                    "--disable-pip-version-check", "--dest", str(dest), *requirements],
                   check=True)
    return sorted(dest.glob("*.whl"))


# --- channel, environments, tests ---------------------------------------------------------

# py-rattler's runtime threads can crash the interpreter while it finalizes (a Fatal Python
# error "PyGILState_Release ... finalizing", about 1 exit in 5 with py-rattler 0.28). So every
# rattler call runs in a child process (this file, subcommand "rattler") that ends with
# os._exit once its answer is written: the crash cannot reach the caller (a pytest run, make).

class SolveError(RuntimeError):
    """The local channel cannot satisfy the specs; the message is the solver's explanation."""


def _rattler(request: dict[str, Any]) -> Any:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "rattler"],
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


def _rattler_child(request: dict[str, Any]) -> Any:
    import rattler
    from rattler.exceptions import SolverError
    from rattler.index import index_fs

    op = request["op"]
    if op == "index":
        asyncio.run(index_fs(Path(request["channel"]), force=True))
        return None
    try:
        records = asyncio.run(rattler.solve(
            [rattler.Channel(Path(request["channel"]).resolve().as_uri())], request["specs"],
            platforms=[request["subdir"], "noarch"],
            virtual_packages=virtual_packages(request.get("cuda"))))
    except SolverError as exc:
        return {"solver_error": str(exc)}
    if op == "create":
        asyncio.run(rattler.install(records, Path(request["prefix"]),
                                    cache_dir=Path(request["cache"]), show_progress=False))
    return [{"name": r.name.normalized, "version": str(r.version), "build": str(r.build),
             "build_number": r.build_number, "subdir": r.subdir, "depends": list(r.depends)}
            for r in records]


def index_channel(channel: Path) -> None:
    """repodata.json for every subdir of a local channel (py-rattler ``index_fs``)."""
    for subdir in ("noarch", this_subdir()):  # conda wants both, even if one is empty
        (channel / subdir).mkdir(parents=True, exist_ok=True)
    _rattler({"op": "index", "channel": str(channel)})


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


def solve(channel: Path, specs: Sequence[str], cuda: str | None = None,
          subdir: str | None = None) -> list[dict[str, Any]]:
    """The records ``rattler.solve`` picks from the local channel (dicts: name, build, ...)."""
    return _rattler({"op": "solve", "channel": str(channel), "specs": list(specs),
                     "cuda": cuda, "subdir": subdir or this_subdir()})


def create_env(channel: Path, specs: Sequence[str], prefix: Path, cache: Path,
               cuda: str | None = None) -> list[dict[str, Any]]:
    """Solve ``specs`` from the local channel and install them into a fresh ``prefix``."""
    return _rattler({"op": "create", "channel": str(channel), "specs": list(specs),
                     "cuda": cuda, "subdir": this_subdir(), "prefix": str(prefix),
                     "cache": str(cache)})


@dataclass(frozen=True)
class EnvTest:
    name: str
    argv: list[str]


def recipe_tests(meta: dict[str, Any]) -> list[EnvTest]:
    """The recipe's ``test:`` section as argv lists (imports via python, commands via bash)."""
    test = meta.get("test") or {}
    out = [EnvTest(f"import {m}", ["python", "-c", f"import {m}"])
           for m in test.get("imports") or []]
    out += [EnvTest(str(c), ["bash", "-e", "-c", str(c)]) for c in test.get("commands") or []]
    return out


def acceptance_tests(path: Path) -> list[EnvTest]:
    data = yaml.safe_load(path.read_text()) or {}
    return [EnvTest(t["name"], ["bash", "-e", "-c", t["command"]]) for t in data["tests"]]


def env_for(prefix: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CONDA_PREFIX")}
    env.update(PATH=f"{prefix / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin",
               CONDA_PREFIX=str(prefix), PREFIX=str(prefix), PYTHONNOUSERSITE="1")
    return env


def run_tests(tests: Sequence[EnvTest], prefix: Path, cwd: Path,
              timeout: float = 120) -> list[tuple[EnvTest, subprocess.CompletedProcess]]:
    """Run each test inside ``prefix``; return the failures (test, completed process)."""
    failures = []
    for test in tests:
        proc = subprocess.run(test.argv, cwd=cwd, env=env_for(prefix), capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0:
            failures.append((test, proc))
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="localbuild.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build a noarch: python recipe into a local channel")
    b.add_argument("recipe")
    b.add_argument("--output-dir", default="build/conda-bld", help="the channel directory")
    sub.add_parser("rattler", help="internal: one py-rattler call, JSON on stdin and stdout")
    args = p.parse_args(argv)
    if args.cmd == "rattler":
        try:
            answer = {"result": _rattler_child(json.loads(sys.stdin.read()))}
            if isinstance(answer["result"], dict):
                answer = answer["result"]
        except Exception as exc:  # reported to the parent, which raises it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter finalization: see _rattler
    out = Path(args.output_dir).resolve()
    with tempfile.TemporaryDirectory(prefix="powerddl-conda-") as tmp:
        for rendered in render.render(args.recipe, python=sys.executable):
            if rendered.skipped:
                continue
            pkg = build_recipe(rendered, out, Path(tmp), log=sys.stderr)
            print(f"built {pkg}")
    index_channel(out)
    print(f"indexed {out} (py-rattler); install with: conda install -c file://{out} powerddl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
