"""What the image tests share (tests/docker): the build context, wheels for an offline
build, and podman/buildah with a private store."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
# What the build context needs from the repository (the Dockerfiles' COPY lines).
CONTEXT = ("pyproject.toml", "README.md", "ddl-core", "launcher", "examples", "docker")
# pip download's platform tags for bookworm's python 3.11 on x86_64 (glibc 2.36)
PLATFORMS = tuple(f"--platform=manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)) + (
    "--platform=manylinux2014_x86_64", "--platform=manylinux1_x86_64",
    "--platform=linux_x86_64")
# what pip needs to build and install powerddl itself in the image, offline
POWERDDL_BUILD = ("setuptools>=68", "wheel", "pyyaml>=6", "rich>=13")

CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
runtime = "runc"
helper_binaries_dir = ["/usr/lib/podman", "/usr/libexec/podman", "/usr/local/libexec/podman"]
"""


def tool(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def arg_defaults(dockerfile: Path) -> dict[str, str]:
    """The ``ARG NAME=default`` lines of a Dockerfile."""
    found = re.findall(r"^ARG (\w+)=(\S+)$", dockerfile.read_text(), re.M)
    return dict(found)


def project_version() -> str:
    return re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]



def make_context(top: Path) -> Path:
    """A build context under ``top``: the repository's CONTEXT, without caches or wheels."""
    ctx = top / "context"
    ctx.mkdir()
    for name in CONTEXT:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, ctx / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.pyc", "*.egg-info", "*.whl"))
        else:
            shutil.copy2(src, ctx / name)
    return ctx


def download_wheels(dest: Path, reqs: list[str], constraints: Path | None = None) -> None:
    """Every wheel ``reqs`` needs, for the image's python (bookworm's 3.11), with this
    machine's pip and its indexes: the build then reads no index (PIP_NO_INDEX=1)."""
    extra = ["-c", str(constraints)] if constraints else []
    out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                          "--python-version=3.11", *PLATFORMS, "-d", str(dest), *extra, *reqs],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        pytest.fail(f"pip download {' '.join(reqs)} failed:\n{out.stderr[-3000:]}")


class Podman:
    """podman/buildah with this session's own config and container store."""

    def __init__(self, top: Path):
        self.top = top
        conf = top / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        storage = top / "storage.conf"
        storage.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{top}/store"\n'
                           f'runroot = "{top}/run"\n')
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf),
                    "CONTAINERS_STORAGE_CONF": str(storage)}
        self.images: list[str] = []
        self.containers: list[str] = []
        self.networks: list[str] = []

    def run(self, *argv: str, timeout: float = 120, check: bool = True,
            tool: str = "podman", **kw) -> subprocess.CompletedProcess:
        out = subprocess.run([tool, *argv], env=self.env, capture_output=True, text=True,
                             timeout=timeout, **kw)
        if check and out.returncode != 0:
            pytest.fail(f"{tool} {' '.join(argv)} exited {out.returncode}:\n"
                        f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        return out

    def close(self) -> None:
        for cid in reversed(self.containers):
            self.run("rm", "--force", "--time", "2", cid, check=False)
        for net in self.networks:
            self.run("network", "rm", "--force", net, check=False)
        for image in reversed(self.images):
            self.run("rmi", "--force", image, check=False)
        # Build leftovers (stage images): this store is the session's own, all of it ours.
        left = self.run("images", "--all", "--quiet", check=False).stdout.split()
        for image in dict.fromkeys(left):
            self.run("rmi", "--force", image, check=False)
        # containers/storage keeps its overlay directory mounted: unmount it, then drop all.
        for mount in sorted(Path("/proc/self/mounts").read_text().splitlines(), reverse=True):
            target = mount.split()[1]
            if target.startswith(str(self.top) + "/"):
                subprocess.run(["umount", "--lazy", target], check=False)
        shutil.rmtree(self.top, ignore_errors=True)




def build_image(podman: Podman, ctx: Path, dockerfile: str, name: str,
                build_args: dict[str, str], timeout: float = 1800) -> tuple[str, float]:
    """``buildah bud`` of ``dockerfile`` in ``ctx``, offline (``PIP_NO_INDEX=1``): the tag
    (registered for removal) and the seconds it took."""
    tag = f"localhost/ddltest-{name}-{uuid.uuid4().hex[:8]}:test"
    args = [a for k, v in {"PIP_NO_INDEX": "1", **build_args}.items()
            for a in ("--build-arg", f"{k}={v}")]
    t0 = time.monotonic()
    podman.run("bud", "--isolation", "chroot", "--format", "docker", "--pull-never",
               "-f", dockerfile, *args, "-t", tag, ".", tool="buildah", cwd=ctx,
               timeout=timeout)
    podman.images.append(tag)
    return tag, time.monotonic() - t0
