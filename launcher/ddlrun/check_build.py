"""``ddlrun --check-build``: what this host can run now, in ``horovodrun --check-build``'s
``[X]``/``[ ]`` layout (or ``--json``), and ``--require NAME`` to make a script stop when
something it needs is missing.

Three steps, as in the rest of the launcher: ``gather()`` collects facts (a JSON-able dict;
it prints nothing), ``render()`` turns facts into text and ``missing()`` checks requirements
against them; both are pure, so tests feed them a facts dict.

Frameworks are probed in children of this python (``ddlrun.check_probes``), each with a
timeout and all at once, so an import that crashes or hangs shows as ``[ ]`` with its
reason. A package that is not installed is told by ``importlib.util.find_spec``
without starting a child. A framework not probed (``--require`` asks for others) shows its
version from its package's metadata, ``checked: False``, and the engines that need it
``[?]`` (``ok: None``).

Facts, by key: ``powerddl`` (version; whether ``import ddl`` works), ``python``,
``frameworks`` (torch, tensorflow, keras), ``engines`` (shm, gloo, nccl, mpi), ``launchers``
(local, ssh, mpirun, slurm, lsf: ``--launcher``'s choices), ``allocation`` (slurm, lsf or
None), ``gpus``, ``shm`` (/dev/shm against the staging area ddl's shared-memory engine
reserves, ``DDL_SHM_MAX_BYTES``), and, from ``run()``, ``required`` and ``missing``.
Every item has ``ok`` and, when it is not ok, ``error``: one line saying why.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from . import version
from .backends.lsf import LsfBackend
from .backends.mpirun import MpirunBackend
from .backends.slurm import SlurmBackend
from .check_probes import PROBE_TIMEOUT, PROBES, Facts, probes_for, run_probe
from .errors import UsageError
from .hosts import detect_allocation
from .preflight import count_gpus

MISSING_EXIT = 3  # as a failed preflight; 2 stays a usage error (an unknown --require name)

FRAMEWORKS = ("torch", "tensorflow", "keras")
ENGINES = ("shm", "gloo", "nccl", "mpi")
LAUNCHERS = ("local", "ssh", "mpirun", "slurm", "lsf")
REQUIREMENTS = (*FRAMEWORKS, *ENGINES, "cuda", "gpu", *LAUNCHERS[1:])

_TITLES = {"torch": "PyTorch", "tensorflow": "TensorFlow", "keras": "Keras"}


def _installed(names: Iterable[str]) -> bool:
    for name in names:
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(name) is not None:
                return True
    return False


# ---------------------------------------------------------------------------- gather
def _not_installed(name: str) -> Facts:
    hint = {"torch": "pip install 'powerddl[torch]'", "mpi4py": "pip install 'powerddl[mpi]'"}
    extra = f" ({hint[name]})" if name in hint else ""
    return {"ok": False, "error": f"{name} is not installed{extra}"}


def _dist_version(name: str) -> str | None:
    """The installed version of the distribution that holds the import package ``name``
    (``tensorflow`` may come from ``tensorflow-cpu``), from its metadata: no import."""
    for dist in importlib.metadata.packages_distributions().get(name, [name]):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def _keras_backend(environ: Mapping[str, str]) -> str:
    """Keras 3's backend as it will choose it: KERAS_BACKEND, else keras.json's, else
    TensorFlow."""
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"]
    home = environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    with contextlib.suppress(OSError, ValueError, AttributeError), \
            open(os.path.join(home, "keras.json")) as f:
        return str(json.load(f).get("backend") or "tensorflow")
    return "tensorflow"


def _unchecked(name: str, environ: Mapping[str, str]) -> Facts:
    """An installed framework that was not imported: its version from the metadata."""
    facts: Facts = {"ok": True, "version": _dist_version(name), "checked": False}
    if name == "keras":
        facts["backend"] = _keras_backend(environ)
    return facts


def _not_checked(name: str) -> Facts:
    return {"ok": None, "error": f"not checked (--require {name} checks it)"}


def _failed(child: Facts, what: str) -> Facts:
    return {"ok": False, "error": f"{what}: {child['error']}"}


def _shm_facts(ddl_facts: Facts, statvfs: Callable[[str], os.statvfs_result]) -> Facts:
    path = ddl_facts.get("shm_dir", "/dev/shm")
    facts: Facts = {"path": path, "size": None, "free": None,
                    "staging_bytes": ddl_facts.get("staging_bytes"),
                    "heap_bytes": ddl_facts.get("heap_bytes")}
    try:
        st = statvfs(path)
    except OSError as exc:
        return {**facts, "ok": False, "error": f"{path}: {exc.strerror}"}
    facts.update(size=st.f_blocks * st.f_frsize, free=st.f_bavail * st.f_frsize)
    need = facts["staging_bytes"]
    if not os.access(path, os.W_OK | os.X_OK):
        return {**facts, "ok": False, "error": f"{path} is not writable by this user"}
    if need is None:
        why = ddl_facts.get("config_error") or ddl_facts.get("error") or "unknown"
        return {**facts, "ok": False, "error": f"staging area size unknown: {why}"}
    if facts["free"] < need:
        fix = ("start the container with a larger /dev/shm (docker run --shm-size=1g, or "
               "--ipc=host) or lower DDL_SHM_MAX_BYTES" if facts["size"] < need else
               "other segments use it (ddlrun --cleanup removes those of killed jobs)")
        return {**facts, "ok": False,
                "error": f"{mib(facts['free'])} free, the staging area needs {mib(need)}: "
                         f"{fix}"}
    return {**facts, "ok": True}


def _launchers() -> Facts:
    mpirun = MpirunBackend.exe()
    paths = {"ssh": shutil.which("ssh"), "mpirun": mpirun and shutil.which(mpirun),
             "slurm": shutil.which("srun") if SlurmBackend.exists() else None,
             "lsf": shutil.which("blaunch") if LsfBackend.exists() else None}
    exes = {"ssh": "ssh", "mpirun": "mpirun", "slurm": "srun", "lsf": "blaunch"}
    out: Facts = {"local": {"ok": True, "path": None}}
    for name, path in paths.items():
        out[name] = ({"ok": True, "path": path} if path else
                     {"ok": False, "path": None, "error": f"{exes[name]} not found on PATH"})
    return out


def _frameworks(child: Mapping[str, Facts], unprobed: Collection[str] = (),
                environ: Mapping[str, str] = os.environ) -> Facts:
    out: Facts = {}
    torch = child.get("torch")
    if "torch" in unprobed:
        out["torch"] = _unchecked("torch", environ)
    elif torch is None:
        out["torch"] = _not_installed("torch")
    elif "error" in torch:
        out["torch"] = _failed(torch, "import torch")
    else:
        out["torch"] = torch["torch"]
    tf = child.get("tensorflow")  # TensorFlow's child probes Keras too
    for name in ("tensorflow", "keras"):
        if "tensorflow" in unprobed and _installed((name,)):
            out[name] = _unchecked(name, environ)
        elif tf is None or (name not in tf and "error" not in tf):
            out[name] = _not_installed(name)
        elif "error" in tf:
            out[name] = _failed(tf, f"import {name}")
        else:
            out[name] = tf[name]
    return out


def _engines(child: Mapping[str, Facts], torch: Facts, ddl_facts: Facts, shm: Facts) -> Facts:
    out: Facts = {}
    if not ddl_facts["ok"]:
        out["shm"] = {"ok": False, "error": f"ddl does not import: {ddl_facts['error']}"}
    else:
        out["shm"] = {"ok": True} if shm["ok"] else {"ok": False, "error": shm["error"]}
    for name in ("gloo", "nccl"):
        if torch.get("checked") is False:
            out[name] = _not_checked(name)
        elif not torch["ok"]:
            out[name] = {"ok": False, "error": f"needs torch ({torch['error']})"}
        else:
            out[name] = dict(child["torch"].get(name, {"ok": False, "error": "not probed"}))
    nccl = out["nccl"]
    if nccl["ok"] and not torch.get("cuda_available"):
        # torch has NCCL but no GPU to run it on: not available now, and the report still
        # says which NCCL a GPU would get
        out["nccl"] = {**nccl, "ok": False,
                       "error": f"{_nccl_text(nccl)}, but {_no_cuda(torch)}"
                       if nccl.get("version") else _no_cuda(torch)}
    elif not nccl["ok"] and not nccl.get("error"):
        nccl["error"] = (f"torch {torch['version']} has no NCCL"
                         if torch.get("cuda") or torch.get("hip") else _no_cuda(torch))
    if not out["gloo"]["ok"] and not out["gloo"].get("error"):
        out["gloo"]["error"] = f"torch {torch['version']} has no Gloo"
    mpi = child.get("mpi")
    if mpi is None:
        out["mpi"] = _not_installed("mpi4py")
    elif "ok" not in mpi:
        out["mpi"] = _failed(mpi, "import mpi4py")
    else:
        out["mpi"] = mpi
    return out


def gather(environ: Mapping[str, str] | None = None, timeout: float = PROBE_TIMEOUT,
           probe: Callable[[str, float], Facts] | None = None,
           statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
           probes: Collection[str] | None = None) -> Facts:
    """Facts about this host (see the module docstring). ``probe(name, timeout)`` runs one
    of ``PROBES`` (default: in a child of this python, under ``environ``); ``probes``: which
    (default all; ``probes_for``), the other installed frameworks are told from metadata."""
    env = os.environ if environ is None else environ
    run = probe or (lambda name, t: run_probe(name, t, env))
    installed = [name for name, (_, packages) in PROBES.items() if _installed(packages)]
    wanted = [name for name in installed if probes is None or name in probes]
    unprobed = set(installed) - set(wanted)
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(PROBES)) as pool:
        futures = {name: pool.submit(run, name, timeout) for name in wanted}
        child = {name: f.result() for name, f in futures.items()}

    ddl_facts = child.get("ddl", _not_installed("ddl"))
    if "ok" not in ddl_facts:
        ddl_facts = _failed(ddl_facts, "import ddl")
    frameworks = _frameworks(child, unprobed, env)
    torch = frameworks["torch"]
    shm = _shm_facts(ddl_facts, statvfs)
    devices = torch.get("devices") if torch["ok"] else None
    gpus = {"nvidia_smi": count_gpus() if shutil.which("nvidia-smi") else None,
            "torch": None if devices is None else len(devices),
            "devices": list(devices or [])}
    return {
        "powerddl": {"version": version(), "ddl": ddl_facts},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "frameworks": frameworks,
        "engines": _engines(child, torch, ddl_facts, shm),
        "launchers": _launchers(),
        "allocation": detect_allocation(env),
        "gpus": gpus,
        "shm": shm,
    }


def _nccl_text(nccl: Facts) -> str:
    """'NCCL 2.30.7 (<library>, loadable)': what torch's NCCL engine would load."""
    text = f"NCCL {nccl['version']}"
    where, error = nccl.get("library"), nccl.get("library_error")
    if where and nccl.get("library_version"):
        return f"{text} ({where}, loadable)"
    if where or error:
        return f"{text} ({f'{where}: ' if where else ''}{error})"
    return text


def _no_cuda(torch: Facts) -> str:
    if not torch.get("cuda") and not torch.get("hip"):
        return f"torch {torch['version']} is a CPU build"
    if torch.get("cuda_error"):
        return f"torch {torch['version']}: {torch['cuda_error']}"
    return f"torch {torch['version']} sees no CUDA device"


# ---------------------------------------------------------------------------- pure
def mib(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def parse_required(values: Iterable[str]) -> tuple[str, ...]:
    """``--require`` values (repeatable, or comma lists) -> names, in order, once each."""
    names: list[str] = []
    for value in values:
        for name in (n.strip().lower() for n in value.split(",")):
            if not name:
                continue
            if name not in REQUIREMENTS:
                raise UsageError(f"--require {name!r}: unknown; choose from "
                                 f"{', '.join(REQUIREMENTS)}")
            if name not in names:
                names.append(name)
    return tuple(names)


def _requirement(facts: Facts, name: str) -> Facts:
    """The item that decides requirement ``name``: {"ok": ..., "error": ...}."""
    if name in FRAMEWORKS:
        return facts["frameworks"][name]
    if name in ENGINES:
        return facts["engines"][name]
    if name in LAUNCHERS:
        return facts["launchers"][name]
    torch = facts["frameworks"]["torch"]
    if name == "cuda":
        if torch.get("checked") is False:
            return _not_checked("cuda")
        if not torch["ok"]:
            return {"ok": False, "error": f"needs torch ({torch['error']})"}
        return {"ok": True} if torch.get("cuda_available") else {"ok": False,
                                                                 "error": _no_cuda(torch)}
    gpus = facts["gpus"]
    seen = max(gpus.get("nvidia_smi") or 0, gpus.get("torch") or 0)
    return {"ok": True} if seen else {"ok": False, "error": _no_gpu(gpus)}


def _no_gpu(gpus: Facts) -> str:
    smi = "nvidia-smi not found" if gpus.get("nvidia_smi") is None else "nvidia-smi lists none"
    by_torch = "no torch" if gpus.get("torch") is None else "torch sees none"
    return f"no GPU seen ({smi}; {by_torch})"


def missing(facts: Facts, required: Sequence[str]) -> list[tuple[str, str]]:
    """(name, why) for each required name this host lacks."""
    out = []
    for name in required:
        item = _requirement(facts, name)
        if not item["ok"]:
            out.append((name, item.get("error") or "not available"))
    return out


def _row(item: Facts, label: str, detail: str = "") -> str:
    mark = {True: "[X]", None: "[?]"}.get(item["ok"], "[ ]")
    if not item["ok"]:
        return f"    {mark} {label}: {item.get('error') or 'not available'}"
    return f"    {mark} {label}{f' {detail}' if detail else ''}"


def _framework_detail(name: str, item: Facts) -> str:
    if item.get("checked") is False:
        backend = f", backend: {item['backend']}" if name == "keras" else ""
        return (f"{item['version']} (installed{backend}; import not checked: --require "
                f"{name} checks it)")
    if name == "torch":
        if item.get("hip"):
            build = f"ROCm {item['hip']} build"
        elif item.get("cuda"):
            build = f"CUDA {item['cuda']} build"
            if item.get("cudnn"):
                build += f", cuDNN {item['cudnn']}"
        else:
            build = "CPU build"
        return f"{item['version']} ({build})"
    if name == "keras":
        return f"{item['version']} (backend: {item.get('backend')})"
    if name == "tensorflow" and item.get("cuda"):
        built = f"CUDA {item['cuda_version']} build" if item.get("cuda_version") \
            else "CUDA build"
        if item.get("cudnn_version"):
            built += f", cuDNN {item['cudnn_version']}"
        return f"{item['version']} ({built}, {item.get('gpus', 0)} GPU(s))"
    return str(item.get("version", ""))


def _engine_detail(name: str, item: Facts) -> str:
    if name == "shm":
        return "(ddl's shared memory, inside a host)"
    if name == "nccl" and item.get("version"):
        return _nccl_text(item).removeprefix("NCCL ")
    if name == "mpi":
        return f"({item['library']}, MPI {item['standard']}, mpi4py {item['mpi4py']})"
    return ""


def _cuda_builds(facts: Facts) -> list[str]:
    """The frameworks here that are CUDA builds (checked ones only)."""
    frameworks = facts["frameworks"]
    out = []
    if frameworks["torch"]["ok"] and frameworks["torch"].get("cuda"):
        out.append("PyTorch")
    if frameworks["tensorflow"]["ok"] and frameworks["tensorflow"].get("cuda"):
        out.append("TensorFlow")
    return out


def render(facts: Facts) -> str:
    """The report, ``horovodrun --check-build``'s layout with ddl's sections."""
    ddl = facts["powerddl"]["ddl"]
    py = facts["python"]
    head = f"PowerDDL v{facts['powerddl']['version']} (python {py['version']}, {py['executable']}"
    head += ")" if ddl["ok"] else f"; ddl does not import: {ddl['error']})"
    lines = [f"{head}:", "", "Available Frameworks:"]
    for name in FRAMEWORKS:
        item = facts["frameworks"][name]
        lines.append(_row(item, _TITLES[name], _framework_detail(name, item) if item["ok"]
                          else ""))
    lines += ["", "Available Engines:"]
    for name in ENGINES:
        item = facts["engines"][name]
        lines.append(_row(item, name, _engine_detail(name, item) if item["ok"] else ""))
    lines += ["", "Available Launchers:"]
    for name in LAUNCHERS:
        item = facts["launchers"][name]
        detail = f"({item['path']})" if item.get("path") else ""
        if name == facts.get("allocation"):
            detail += " in this allocation"
        lines.append(_row(item, name, detail.strip()))
    gpus = facts["gpus"]
    lines += ["", "GPUs:", _row(_requirement(facts, "cuda"), "CUDA")]
    smi = gpus.get("nvidia_smi")
    lines.append(f"    nvidia-smi: {'not found' if smi is None else smi}; torch sees "
                 f"{'-' if gpus.get('torch') is None else gpus['torch']}")
    for index, device in enumerate(gpus.get("devices", [])):
        lines.append(f"    {index}: {device}")
    builds = _cuda_builds(facts)
    if builds and not _requirement(facts, "gpu")["ok"]:
        runs = "builds run" if len(builds) > 1 else "build runs"
        lines.append(f"    No GPU is visible: the {' and '.join(builds)} CUDA {runs} on the "
                     "CPU here (on GPU servers: docker run --gpus all, with the NVIDIA "
                     "container toolkit)")
    shm = facts["shm"]
    lines += ["", "Shared Memory:"]
    if shm.get("size") is not None:
        lines.append(f"    {shm['path']}: {mib(shm['size'])}, {mib(shm['free'])} free")
    if shm.get("staging_bytes") is not None:
        label = f"staging area {mib(shm['staging_bytes'])} (DDL_SHM_MAX_BYTES)"
        lines.append(_row(shm, label, "fits"))
        if shm.get("heap_bytes"):
            lines.append(f"    ddl.malloc() adds {mib(shm['heap_bytes'])} per rank "
                         "(DDL_SHM_HEAP_BYTES) when used")
    else:
        lines.append(_row(shm, shm["path"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- act
def run(as_json: bool, require: Sequence[str], note: Callable[[str], None],
        facts: Facts | None = None) -> int:
    """``ddlrun --check-build [--json] [--require NAME]``: print, then 0, or
    ``MISSING_EXIT`` with one line naming what is missing."""
    required = parse_required(require)
    facts = gather(probes=probes_for(required)) if facts is None else facts
    lacking = missing(facts, required)
    if as_json:
        facts = {**facts, "required": list(required),
                 "missing": {name: why for name, why in lacking}}
        print(json.dumps(facts, indent=2), flush=True)
    else:
        print(render(facts), flush=True)
    if lacking:
        note("--check-build: missing " + "; ".join(f"{name} ({why})" for name, why in lacking))
        return MISSING_EXIT
    return 0
