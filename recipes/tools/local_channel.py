"""An offline conda channel for rattler-build: PyPI wheels as conda packages and a stub python.

rattler-build solves its host and test environments from conda channels, and none is
reachable from CI (only PyPI and Debian are). This module makes, from what *is* reachable,
the few packages those environments need; rattler-build does everything else (rendering,
the build, the noarch-python layout, the tests):

- ``wheel_to_conda``: a PyPI wheel as a conda package (pure wheels: ``noarch: python`` with
  their console scripts in ``info/link.json``; others: this platform's subdir, files under
  ``lib/pythonX.Y/site-packages``); ``depends`` from Requires-Dist (markers evaluated for
  this interpreter, extras dropped, ``~=`` spelled out).
- ``stub_python``: a ``python`` package that reuses this machine's interpreter: ``bin/python*``
  are symlinks to it and ``pyvenv.cfg`` makes the prefix its ``sys.prefix`` (a venv in conda
  clothes). It is not a conda-forge python: the standard library is the machine's.
- ``stub_package``: an empty package carrying only metadata (the solver tests' stand-ins for
  pytorch, tensorflow, ... and for the rendered powerai/_powerai_select builds).
- ``make_channel``: all of the above for a list of requirements, then indexed
  (rattler_env.index_channel, py-rattler's ``index_fs``).

Packages are written with conda-package-handling (``.conda``, zstd level 3).
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterable, Sequence
from email.parser import Parser
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rattler_env  # noqa: E402  (a sibling module; this file also runs as a script)

PY_VER = f"{sys.version_info.major}.{sys.version_info.minor}"
SP_DIR = f"lib/python{PY_VER}/site-packages"


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
                  link: dict[str, Any] | None = None) -> Path:
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
    subdir = out_dir / index["subdir"]
    subdir.mkdir(parents=True, exist_ok=True)
    name = f"{index['name']}-{index['version']}-{index['build']}.conda"
    all_files = files + [p.relative_to(root).as_posix() for p in sorted(info.rglob("*"))
                         if p.is_file()]
    api.create(str(root), all_files, name, str(subdir), compression_level=3)
    return subdir / name


def stub_package(index: dict[str, Any], out_dir: Path, work: Path) -> Path:
    """An empty package carrying only ``index`` (name, version, build, depends, ...)."""
    root = work / f"{index['name']}-{index['version']}-{index['build']}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return write_package(root, index, out_dir)


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
    """Requires-Dist lines -> conda depends (markers evaluated here, extras dropped)."""
    from packaging.requirements import Requirement

    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        spec = _conda_specifier(str(req.specifier))
        out.append(f"{conda_name(req.name)} {spec}".strip())
    return out


def _console_scripts(dist_info: Path) -> list[str]:
    eps = dist_info / "entry_points.txt"
    if not eps.is_file():
        return []
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    parser.read_string(eps.read_text())
    if not parser.has_section("console_scripts"):
        return []
    return [f"{k} = {v}" for k, v in parser.items("console_scripts")]


def wheel_to_conda(wheel: Path, out_dir: Path, work: Path) -> Path:
    """One wheel as a conda package: noarch python if pure, else this platform's subdir."""
    root = work / wheel.stem
    unpacked = root.with_suffix(".unpacked")
    for d in (root, unpacked):
        shutil.rmtree(d, ignore_errors=True)
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
    depends = requires_to_depends(meta.get_all("Requires-Dist", []))
    major, minor = sys.version_info[:2]
    if pure:
        index = {"noarch": "python", "subdir": "noarch", "build": "pyh_wheel_0",
                 "depends": [f"python {meta.get('Requires-Python', '').replace(' ', '')}"
                             .strip(), *depends]}
        link = {"noarch": {"type": "python", "entry_points": _console_scripts(dist_info)},
                "package_metadata_version": 1}
    else:  # console scripts of binary wheels are not generated (none is needed here)
        index = {"subdir": rattler_env.this_subdir(), "build": f"py{major}{minor}_wheel_0",
                 "depends": [f"python >={major}.{minor},<{major}.{minor + 1}.0a0", *depends]}
        link = None
    index.update(name=conda_name(meta["Name"]), version=meta["Version"], build_number=0,
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
             "build_number": 0, "depends": [], "subdir": rattler_env.this_subdir(),
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


def make_channel(channel: Path, requirements: Sequence[str], work: Path) -> list[Path]:
    """The stub python + ``requirements`` (and their dependencies) from wheels, indexed."""
    made = [stub_python(channel, work)]
    for wheel in download_wheels(requirements, work / "wheels"):
        made.append(wheel_to_conda(wheel, channel, work / "wheelpkgs"))
    rattler_env.index_channel(channel)
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="local_channel.py", description=__doc__.splitlines()[0])
    p.add_argument("channel", help="the channel directory to create or extend")
    p.add_argument("requirements", nargs="+", help="PEP 508 requirements, e.g. 'pip' 'numpy>=1.24'")
    p.add_argument("--work", default="build/conda-work", help="scratch directory")
    args = p.parse_args(argv)
    for pkg in make_channel(Path(args.channel).resolve(), args.requirements,
                            Path(args.work).resolve()):
        print(pkg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
