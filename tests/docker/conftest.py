"""The image tests' podman/buildah store and bookworm base, made once per test session
and shared by the CPU and CUDA image tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest

from tests.docker.images_lib import Podman


@pytest.fixture(scope="session")
def podman(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("image tests need root (buildah --isolation chroot, podman networks)")
    missing = [t for t in ("podman", "buildah", "debootstrap", "runc") if not shutil.which(t)]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (Debian: apt-get install "
                    "podman buildah runc debootstrap)")
    box = Podman(tmp_path_factory.mktemp("podman"))
    yield box
    box.close()


@pytest.fixture(scope="session")
def base_image(podman):
    """A bookworm minbase root filesystem, imported as an image (made once per session)."""
    rootfs = podman.top / "rootfs"
    t0 = time.monotonic()
    out = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs),
                          "http://deb.debian.org/debian"], capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        pytest.fail(f"debootstrap failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    tag = f"localhost/ddltest-base-{uuid.uuid4().hex[:8]}:bookworm"
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."],
                           stdout=subprocess.PIPE)
    podman.run("import", "-", tag, stdin=tar.stdout, timeout=300)
    assert tar.wait(timeout=60) == 0
    podman.images.append(tag)
    shutil.rmtree(rootfs)
    print(f"base image {tag}: {time.monotonic() - t0:.0f} s")
    return tag


