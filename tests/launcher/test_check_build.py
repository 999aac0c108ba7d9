"""``ddlrun --check-build``: the pure rendering and requirement check from facts dicts, the
probes' handling of broken imports, and real runs of the installed ``ddlrun`` on this
machine (torch's CPU or CUDA build, no GPU; TensorFlow where installed)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from ddlrun_testlib import PY, REPO

from ddlrun import check_build
from ddlrun.check_build import gather, missing, parse_required, render, run, run_probe
from ddlrun.errors import UsageError

BIN = Path(sys.executable).parent
DDLRUN = [str(BIN / "ddlrun")] if (BIN / "ddlrun").exists() else [PY, "-m", "ddlrun"]
HAS_TF = importlib.util.find_spec("tensorflow") is not None
HAS_KERAS = importlib.util.find_spec("keras") is not None


def cpu_host() -> dict:
    """Facts of a CPU host with torch and MPI, without TensorFlow or Keras."""
    return {
        "powerddl": {"version": "0.1.0", "ddl": {"ok": True, "version": "0.1.0",
                                                 "shm_dir": "/dev/shm"}},
        "python": {"version": "3.11.7", "executable": "/env/bin/python"},
        "frameworks": {
            "torch": {"ok": True, "version": "2.13.0+cpu", "cuda": None, "hip": None,
                      "cuda_available": False, "devices": []},
            "tensorflow": {"ok": False, "error": "tensorflow is not installed"},
            "keras": {"ok": False, "error": "keras is not installed"},
        },
        "engines": {
            "shm": {"ok": True},
            "gloo": {"ok": True},
            "nccl": {"ok": False, "error": "torch 2.13.0+cpu is a CPU build"},
            "mpi": {"ok": True, "library": "Open MPI v5.0.11", "standard": "3.1",
                    "mpi4py": "4.1.2", "library_version": "Open MPI v5.0.11, package: ..."},
        },
        "launchers": {"local": {"ok": True, "path": None},
                      "ssh": {"ok": True, "path": "/usr/bin/ssh"},
                      "mpirun": {"ok": True, "path": "/env/bin/mpirun"},
                      "slurm": {"ok": False, "path": None, "error": "srun not found on PATH"},
                      "lsf": {"ok": False, "path": None, "error": "blaunch not found on PATH"}},
        "allocation": None,
        "gpus": {"nvidia_smi": None, "torch": 0, "devices": []},
        "shm": {"path": "/dev/shm", "size": 64 << 20, "free": 60 << 20,
                "staging_bytes": 32 << 20, "heap_bytes": 256 << 20, "ok": True},
    }


def gpu_host() -> dict:
    facts = cpu_host()
    devices = ["NVIDIA H200", "NVIDIA H200"]
    facts["frameworks"]["torch"] = {"ok": True, "version": "2.13.0+cu128", "cuda": "12.8",
                                    "hip": None, "cuda_available": True, "devices": devices}
    facts["frameworks"]["keras"] = {"ok": True, "version": "3.15.1", "backend": "torch"}
    facts["engines"]["nccl"] = {"ok": True, "version": "2.27.3"}
    facts["launchers"]["slurm"] = {"ok": True, "path": "/usr/bin/srun"}
    facts["allocation"] = "slurm"
    facts["gpus"] = {"nvidia_smi": 2, "torch": 2, "devices": devices}
    return facts


def section(text: str, title: str) -> list[str]:
    """The rows under one ``Title:`` heading, up to the blank line."""
    lines = text.splitlines()
    start = lines.index(f"{title}:") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


# ---------------------------------------------------------------------------- rendering
def test_render_has_horovods_layout_with_ddls_sections():
    text = render(cpu_host())
    lines = text.splitlines()
    assert lines[0] == "PowerDDL v0.1.0 (python 3.11.7, /env/bin/python):"
    assert lines[1] == ""
    headings = [ln for ln in lines if ln and not ln.startswith(" ")][1:]
    assert headings == ["Available Frameworks:", "Available Engines:", "Available Launchers:",
                        "GPUs:", "Shared Memory:"]
    assert section(text, "Available Frameworks") == [
        "    [X] PyTorch 2.13.0+cpu (CPU build)",
        "    [ ] TensorFlow: tensorflow is not installed",
        "    [ ] Keras: keras is not installed",
    ]
    assert section(text, "Available Engines") == [
        "    [X] shm (ddl's shared memory, inside a host)",
        "    [X] gloo",
        "    [ ] nccl: torch 2.13.0+cpu is a CPU build",
        "    [X] mpi (Open MPI v5.0.11, MPI 3.1, mpi4py 4.1.2)",
    ]
    assert section(text, "Available Launchers") == [
        "    [X] local",
        "    [X] ssh (/usr/bin/ssh)",
        "    [X] mpirun (/env/bin/mpirun)",
        "    [ ] slurm: srun not found on PATH",
        "    [ ] lsf: blaunch not found on PATH",
    ]
    assert section(text, "GPUs") == ["    [ ] CUDA: torch 2.13.0+cpu is a CPU build",
                                     "    nvidia-smi: not found; torch sees 0"]
    assert section(text, "Shared Memory") == [
        "    /dev/shm: 64.0 MiB, 60.0 MiB free",
        "    [X] staging area 32.0 MiB (DDL_SHM_MAX_BYTES) fits",
        "    ddl.malloc() adds 256.0 MiB per rank (DDL_SHM_HEAP_BYTES) when used",
    ]


def test_render_a_gpu_host_names_builds_versions_and_devices():
    text = render(gpu_host())
    assert "    [X] PyTorch 2.13.0+cu128 (CUDA 12.8 build)" in section(text,
                                                                   "Available Frameworks")
    assert "    [X] Keras 3.15.1 (backend: torch)" in text
    assert "    [X] nccl 2.27.3" in section(text, "Available Engines")
    assert "    [X] slurm (/usr/bin/srun) in this allocation" in text
    assert section(text, "GPUs") == ["    [X] CUDA", "    nvidia-smi: 2; torch sees 2",
                                     "    0: NVIDIA H200", "    1: NVIDIA H200"]


def test_render_a_cuda_build_without_a_gpu_says_what_a_gpu_would_get():
    # a CUDA image on a machine (or a container started without --gpus)
    facts = cpu_host()
    facts["frameworks"]["torch"] = {"ok": True, "version": "2.15.0+cu132", "cuda": "13.2",
                                    "hip": None, "cuda_available": False, "devices": [],
                                    "cudnn": "9.26.0"}
    facts["engines"]["nccl"] = {
        "ok": False, "version": "2.30.7", "library": "/v/nvidia/nccl/lib/libnccl.so.2",
        "library_version": "2.30.7",
        "error": "NCCL 2.30.7 (/v/nvidia/nccl/lib/libnccl.so.2, loadable), but torch "
                 "2.15.0+cu132 sees no CUDA device"}
    facts["frameworks"]["tensorflow"] = {"ok": True, "version": "2.21.0", "cuda": True,
                                         "gpus": 0, "cuda_version": "12.5.1",
                                         "cudnn_version": "9"}
    text = render(facts)
    frameworks = section(text, "Available Frameworks")
    assert "    [X] PyTorch 2.15.0+cu132 (CUDA 13.2 build, cuDNN 9.26.0)" in frameworks
    assert "    [X] TensorFlow 2.21.0 (CUDA 12.5.1 build, cuDNN 9, 0 GPU(s))" in frameworks
    assert ("    [ ] nccl: NCCL 2.30.7 (/v/nvidia/nccl/lib/libnccl.so.2, loadable), but torch "
            "2.15.0+cu132 sees no CUDA device") in section(text, "Available Engines")
    assert section(text, "GPUs")[-1] == (
        "    No GPU is visible: the PyTorch and TensorFlow CUDA builds run on the CPU here (on "
        "GPU servers: docker run --gpus all, with the NVIDIA container toolkit)")
    # a CPU host says nothing of the kind
    assert "No GPU is visible" not in render(cpu_host())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_torch_probe_finds_the_nccl_library_it_loaded():
    facts = run_probe("torch")
    nccl = facts["nccl"]
    if not facts["torch"]["cuda"]:
        assert "library" not in nccl  # a CPU build: no NCCL to look for
        return
    assert nccl["library"].endswith("libnccl.so.2") and Path(nccl["library"]).exists(), nccl
    assert nccl["library_version"] == nccl["version"], nccl
    assert facts["torch"]["cudnn"], facts["torch"]


def test_render_a_broken_host_gives_every_reason_in_one_line():
    facts = cpu_host()
    facts["powerddl"]["ddl"] = {"ok": False, "error": "ModuleNotFoundError: No module named "
                                                      "'numpy'"}
    facts["frameworks"]["torch"] = {"ok": False, "error": "import torch: no answer within "
                                                          "120 s (a hanging import?)"}
    facts["shm"] = {"path": "/dev/shm", "size": 16 << 20, "free": 16 << 20,
                    "staging_bytes": 32 << 20, "heap_bytes": None, "ok": False,
                    "error": "16.0 MiB free, the staging area needs 32.0 MiB: ..."}
    text = render(facts)
    assert text.splitlines()[0].endswith(
        "; ddl does not import: ModuleNotFoundError: No module named 'numpy'):")
    assert ("    [ ] PyTorch: import torch: no answer within 120 s (a hanging import?)"
            in text.splitlines())
    assert ("    [ ] staging area 32.0 MiB (DDL_SHM_MAX_BYTES): 16.0 MiB free, the staging "
            "area needs 32.0 MiB: ..." in text.splitlines())
    assert "ddl.malloc()" not in text
    # every row of a section is a check box with four spaces before it
    for title in ("Available Frameworks", "Available Engines", "Available Launchers"):
        rows = section(text, title)  # an empty section would pass ``all`` unseen
        assert rows and all(row[:8] in ("    [X] ", "    [ ] ") for row in rows), title


# ---------------------------------------------------------------------------- --require
def test_parse_required_takes_repeats_and_comma_lists_once_each():
    assert parse_required(["nccl,gpu", "shm", " GPU ", "nccl,"]) == ("nccl", "gpu", "shm")
    assert parse_required([]) == ()
    with pytest.raises(UsageError, match=r"--require 'ncll': unknown; choose from torch, "):
        parse_required(["gloo,ncll"])


def test_missing_names_what_the_host_lacks_and_why():
    cpu = cpu_host()
    assert missing(cpu, ("torch", "gloo", "shm", "mpi", "ssh", "mpirun")) == []
    assert missing(cpu, ("nccl", "cuda", "gpu", "tensorflow", "lsf")) == [
        ("nccl", "torch 2.13.0+cpu is a CPU build"),
        ("cuda", "torch 2.13.0+cpu is a CPU build"),
        ("gpu", "no GPU seen (nvidia-smi not found; torch sees none)"),
        ("tensorflow", "tensorflow is not installed"),
        ("lsf", "blaunch not found on PATH"),
    ]
    assert missing(gpu_host(), ("nccl", "cuda", "gpu", "keras", "slurm")) == []
    # a GPU nvidia-smi lists but a CPU torch cannot use: a GPU, but no CUDA
    facts = cpu_host()
    facts["gpus"]["nvidia_smi"] = 4
    assert missing(facts, ("gpu", "cuda")) == [("cuda", "torch 2.13.0+cpu is a CPU build")]
    facts["frameworks"]["torch"] = {"ok": False, "error": "torch is not installed"}
    facts["gpus"] = {"nvidia_smi": 0, "torch": None, "devices": []}
    assert missing(facts, ("cuda", "gpu")) == [
        ("cuda", "needs torch (torch is not installed)"),
        ("gpu", "no GPU seen (nvidia-smi lists none; no torch)")]
    assert set(check_build.REQUIREMENTS) == {*check_build.FRAMEWORKS, *check_build.ENGINES,
                                             "cuda", "gpu", "ssh", "mpirun", "slurm", "lsf"}


def test_run_prints_json_with_required_and_missing_and_exits_3(capsys):
    notes: list[str] = []
    code = run(True, ["nccl,gloo", "cuda"], notes.append, facts=cpu_host())
    assert code == check_build.MISSING_EXIT == 3
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"powerddl", "python", "frameworks", "engines", "launchers",
                         "allocation", "gpus", "shm", "required", "missing"}
    assert data["required"] == ["nccl", "gloo", "cuda"]
    assert data["missing"] == {"nccl": "torch 2.13.0+cpu is a CPU build",
                               "cuda": "torch 2.13.0+cpu is a CPU build"}
    assert notes == ["--check-build: missing nccl (torch 2.13.0+cpu is a CPU build); "
                     "cuda (torch 2.13.0+cpu is a CPU build)"]
    assert run(False, ["gloo", "shm"], notes.append, facts=cpu_host()) == 0
    assert capsys.readouterr().out == render(cpu_host()) + "\n"
    assert len(notes) == 1


# ---------------------------------------------------------------------------- probes
def _fake_package(tmp_path: Path, name: str, body: str) -> dict[str, str]:
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text(body)
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def test_a_framework_whose_import_fails_is_shown_with_the_reason(tmp_path):
    env = _fake_package(tmp_path, "torch", "raise ImportError('libcudart.so.12: cannot open "
                                           "shared object file: No such file or directory')\n")
    real = {"ddl", "torch"}  # the others are not what this test is about: skip their imports
    facts = gather(env, probe=lambda name, t: run_probe(name, t, env) if name in real
                   else {"error": "not probed in this test"})
    torch = facts["frameworks"]["torch"]
    assert torch == {"ok": False, "error": "ImportError: libcudart.so.12: cannot open shared "
                                           "object file: No such file or directory"}
    assert facts["engines"]["gloo"] == {"ok": False, "error": f"needs torch ({torch['error']})"}
    assert facts["engines"]["shm"] == {"ok": True}  # ddl's own engine needs no framework
    assert missing(facts, ("torch",)) == [("torch", torch["error"])]


def test_a_hanging_import_times_out_into_a_reason(tmp_path):
    env = _fake_package(tmp_path, "torch", "import time\ntime.sleep(60)\n")
    assert run_probe("torch", 2.0, env) == {
        "error": "no answer within 2 s (a hanging import?)"}


def test_a_crashing_probe_reports_its_exit_and_last_line(tmp_path):
    env = _fake_package(tmp_path, "torch", "import os, sys\nsys.stderr.write('boom\\n')\n"
                                           "sys.stderr.flush()\nos._exit(7)\n")
    assert run_probe("torch", 60.0, env) == {"error": "the probe exited 7: boom"}


def test_require_imports_only_what_its_checks_need():
    assert check_build.probes_for(()) == set(check_build.PROBES)  # the whole report
    assert check_build.probes_for(("nccl", "gloo")) == {"ddl", "mpi", "torch"}
    assert check_build.probes_for(("keras",)) == {"ddl", "mpi", "tensorflow"}
    assert check_build.probes_for(("shm", "ssh")) == {"ddl", "mpi"}
    asked = []

    def probe(name, timeout):
        asked.append(name)
        return {"error": "not probed in this test"}

    facts = gather(probe=probe, probes={"ddl"})
    assert asked == ["ddl"]
    torch = facts["frameworks"]["torch"]
    assert torch == {"ok": True, "version": metadata.version("torch"), "checked": False}
    assert facts["engines"]["gloo"] == {"ok": None,
                                        "error": "not checked (--require gloo checks it)"}
    text = render(facts)
    assert f"    [X] PyTorch {torch['version']} (installed; import not checked" in text
    assert "    [?] gloo: not checked (--require gloo checks it)" in text
    assert "    [?] CUDA: not checked (--require cuda checks it)" in text
    if HAS_TF:
        tf = facts["frameworks"]["tensorflow"]
        assert tf["ok"] and tf["checked"] is False and tf["version"] == metadata.version(
            metadata.packages_distributions()["tensorflow"][0])


# ---------------------------------------------------------------------------- real runs
def _ddlrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*DDLRUN, *args], capture_output=True, text=True, timeout=300,
                          cwd=str(REPO), env=env)


# the real runs need torch (the dev extra's; its CPU build or PyPI's CUDA build)
TORCH = pytest.importorskip("torch") if importlib.util.find_spec("torch") else None
NO_CUDA = (f"torch {TORCH.__version__} sees no CUDA device" if TORCH and TORCH.version.cuda
           else f"torch {TORCH.__version__ if TORCH else '-'} is a CPU build")


@pytest.fixture(scope="module")
def json_run() -> subprocess.CompletedProcess:
    return _ddlrun("--check-build", "--json", "--require", "nccl", "--require", "cuda,gloo")


def test_real_json_run_tells_this_machines_facts(json_run):
    assert json_run.returncode == 3, json_run.stderr
    facts = json.loads(json_run.stdout)
    assert facts["powerddl"]["version"] == metadata.version("powerddl")
    assert facts["powerddl"]["ddl"]["ok"] is True
    torch = facts["frameworks"]["torch"]
    assert torch["ok"] and torch["version"] == TORCH.__version__
    assert torch["version"].startswith(metadata.version("torch").split("+")[0])
    assert torch["cuda"] == TORCH.version.cuda and torch["cuda_available"] is False
    for name, installed in (("tensorflow", HAS_TF), ("keras", HAS_KERAS)):
        item = facts["frameworks"][name]
        assert item["ok"] is installed, item
        if installed:  # tensorflow-cpu, tensorflow or tf-nightly: whichever holds it
            dist = metadata.packages_distributions()[name][0]
            assert item["version"] == metadata.version(dist)
        else:
            assert item["error"] == f"{name} is not installed"
    if HAS_KERAS:
        assert facts["frameworks"]["keras"]["backend"] == os.environ.get("KERAS_BACKEND",
                                                                         "tensorflow")
    engines = facts["engines"]
    assert engines["shm"] == {"ok": True} and engines["gloo"] == {"ok": True}
    nccl = engines["nccl"]
    if TORCH.version.cuda:  # PyPI's build: the NCCL it would load, and no GPU to run it on
        assert nccl["ok"] is False and nccl["version"] == nccl["library_version"], nccl
        assert nccl["error"] == (f"NCCL {nccl['version']} ({nccl['library']}, loadable), "
                                 f"but {NO_CUDA}"), nccl
    else:
        assert nccl == {"ok": False, "error": NO_CUDA}
    if importlib.util.find_spec("mpi4py") is not None:
        from mpi4py import MPI

        major, minor = MPI.Get_version()
        assert engines["mpi"]["ok"] and engines["mpi"]["standard"] == f"{major}.{minor}"
        assert engines["mpi"]["library"] in MPI.Get_library_version()
    assert facts["gpus"]["torch"] == 0 and facts["gpus"]["devices"] == []
    st = os.statvfs("/dev/shm")
    assert facts["shm"]["size"] == st.f_blocks * st.f_frsize and facts["shm"]["ok"] is True
    from ddl import config

    assert facts["shm"]["staging_bytes"] == config.get("DDL_SHM_MAX_BYTES")
    assert facts["required"] == ["nccl", "cuda", "gloo"]
    assert set(facts["missing"]) == {"nccl", "cuda"}
    assert json_run.stderr.strip().splitlines()[-1] == (
        f"ddlrun: --check-build: missing nccl ({nccl['error']}); cuda ({NO_CUDA})")


def test_real_text_run_passes_what_is_present(json_run):
    out = _ddlrun("--check-build", "--require", "shm,gloo,torch")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    frameworks = section(out.stdout, "Available Frameworks")
    build = (f"CUDA {TORCH.version.cuda} build, cuDNN " if TORCH.version.cuda else "CPU build")
    assert frameworks[0].startswith(f"    [X] PyTorch {TORCH.__version__} ({build}")
    assert frameworks[1].startswith("    [X] TensorFlow " if HAS_TF else
                                    "    [ ] TensorFlow: tensorflow is not installed")
    engines = section(out.stdout, "Available Engines")
    assert engines[:2] == ["    [X] shm (ddl's shared memory, inside a host)", "    [X] gloo"]
    assert engines[2].startswith("    [ ] nccl: ") and engines[2].endswith(NO_CUDA)
    # the text and the JSON are the same facts, but for /dev/shm's free space, which other
    # jobs on the machine change between the two runs
    def steady(text: str) -> str:
        return re.sub(r", [^,]+ free$", ", ... free", text, flags=re.M)

    text = out.stdout.rstrip("\n")
    assert re.search(r"^    /dev/shm: .+, .+ free$", text, re.M), text
    assert steady(render(json.loads(json_run.stdout))) == steady(text)


def test_a_staging_area_larger_than_dev_shm_is_missing_shm_with_the_fix():
    st = os.statvfs("/dev/shm")
    too_big = st.f_blocks * st.f_frsize + (1 << 30)
    env = {**os.environ, "DDL_SHM_MAX_BYTES": str(too_big)}
    # ddl's own child, for real, reads the registry under this environment
    facts = gather(env, probe=lambda name, t: run_probe(name, t, env) if name == "ddl"
                   else {"error": "not probed in this test"})
    shm = facts["shm"]
    assert shm["ok"] is False and shm["staging_bytes"] == too_big
    assert shm["error"].startswith(f"{check_build.mib(shm['free'])} free, the staging area "
                                   f"needs {check_build.mib(too_big)}: start the container "
                                   "with a larger /dev/shm (docker run --shm-size=1g")
    assert facts["engines"]["shm"] == {"ok": False, "error": shm["error"]}
    assert missing(facts, ("shm",)) == [("shm", shm["error"])]


@pytest.mark.parametrize("argv, message", [
    (("--check-build", "--require", "ncll"), "--require 'ncll': unknown"),
    (("--check-build", "python", "train.py"), "--check-build runs no program"),
    (("--json",), "--json and --require go with --check-build"),
    (("--require", "gpu", "python", "train.py"), "--json and --require go with --check-build"),
])
def test_usage_errors_exit_2_before_probing(argv, message):
    out = _ddlrun(*argv)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.startswith(f"ddlrun: error: {message}")
    assert len(out.stderr.splitlines()) == 1


def test_docker_entrypoint_banner_full_runs_check_build(tmp_path):
    # a stand-in ddlrun records how the entrypoint calls it (the real one is run above)
    fake = tmp_path / "ddlrun"
    fake.write_text('#!/bin/sh\necho "ddlrun called with: $*" >&2\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join((str(tmp_path), str(BIN), os.environ["PATH"])),
           "DDL_BANNER": "full"}
    entrypoint = str(REPO / "docker" / "entrypoint.sh")
    out = subprocess.run(["bash", entrypoint, "echo", "hi"], capture_output=True, text=True,
                         timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert (out.returncode, out.stdout, out.stderr) == (0, "hi\n",
                                                        "ddlrun called with: --check-build\n")
    # the default for a command, or a shell without a terminal: the fast one-line banner
    env["DDL_BANNER"] = "1"
    for argv in (["true"], ["bash", "-c", "true"], ["bash"]):
        out = subprocess.run(["bash", entrypoint, *argv], capture_output=True, text=True,
                             timeout=60, env=env, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        assert out.stderr.startswith("PowerDDL image: python "), out.stderr
        assert "ddlrun called" not in out.stderr


def test_facts_dicts_of_these_tests_render_without_mutating_them():
    facts = gpu_host()
    before = copy.deepcopy(facts)
    render(facts)
    missing(facts, check_build.REQUIREMENTS)
    assert facts == before
