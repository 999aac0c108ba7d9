"""The probes of ``ddlrun --check-build``, each run in a child of this python.

Frameworks are probed in child processes of this python (``python -c ... <probe>``), each
with a timeout and all at once: importing TensorFlow takes seconds, and an import that
crashes or hangs (a broken CUDA install) must show as ``[ ]`` with its reason, not take
ddlrun down. With ``--require``, only the probes the required names need run
(``probes_for``: ``--require nccl,gloo`` imports torch, never TensorFlow).

A probe (``PROBES``) returns a JSON-able dict of facts, which the child prints as its last
line of stdout (``child_main``); ``run_probe`` starts the child and reads that line, or
turns a timeout or a crash into ``{"error": why}``. The child imports this module only,
not the report (``ddlrun.check_build``). Like ``ddlrun.core``, this module imports ddl:
on purpose, to report why it fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

PROBE_TIMEOUT = 120.0  # seconds per child; TensorFlow's import alone takes ~5 s
_REASON_CHARS = 200

Facts = dict[str, Any]


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line[:_REASON_CHARS]


def _probe_ddl() -> Facts:
    try:
        import ddl
        from ddl import config
        from ddl.engines import segments, shm  # noqa: F401  (the engine must import)
    except Exception as exc:  # any import failure is a fact to show, not a crash
        return {"ok": False, "error": _reason(exc)}
    facts: Facts = {"ok": True, "version": ddl.__version__, "shm_dir": segments.SHM_DIR}
    try:
        # the registry's values, so DDL_SHM_* in this environment count as they will in a job
        facts["staging_bytes"] = config.get("DDL_SHM_MAX_BYTES")
        facts["heap_bytes"] = config.get("DDL_SHM_HEAP_BYTES")
    except Exception as exc:
        facts["config_error"] = _reason(exc)
    return facts


def _probe_torch() -> Facts:
    try:
        import torch
    except Exception as exc:
        return {"torch": {"ok": False, "error": _reason(exc)}}
    cuda = torch.version.cuda  # None on a CPU build
    hip = getattr(torch.version, "hip", None)
    try:
        cuda_ok = bool(cuda or hip) and torch.cuda.is_available()
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
                   ] if cuda_ok else []
    except Exception as exc:
        cuda_ok, devices = False, []
        cuda_error = _reason(exc)
    else:
        cuda_error = None
    out: Facts = {"torch": {"ok": True, "version": torch.__version__, "cuda": cuda, "hip": hip,
                            "cuda_available": cuda_ok, "cuda_error": cuda_error,
                            "devices": devices}}
    try:
        from ddl.engines.device import available  # ddl's own rule for its device engines
    except Exception as exc:
        why = f"ddl does not import: {_reason(exc)}"
        out["gloo"] = out["nccl"] = {"ok": False, "error": why}
        return out
    if cuda:
        try:
            out["torch"]["cudnn"] = _cudnn_text(torch.backends.cudnn.version())
        except Exception as exc:
            out["torch"]["cudnn_error"] = _reason(exc)
    out["gloo"] = {"ok": available("gloo")}
    nccl: Facts = {"ok": available("nccl")}
    if nccl["ok"]:
        try:
            got = torch.cuda.nccl.version()
            nccl["version"] = ".".join(map(str, got)) if isinstance(got, tuple) else str(got)
        except Exception as exc:
            nccl["version"], nccl["version_error"] = None, _reason(exc)
        nccl.update(_nccl_library())
    out["nccl"] = nccl
    return out


def _cudnn_text(code: int | None) -> str | None:
    """cuDNN's version number (9.x: major*10000 + minor*100 + patch) as text."""
    if not code:
        return None
    major, rest = divmod(int(code), 10000) if code >= 10000 else divmod(int(code), 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def _nccl_library() -> Facts:
    """The libnccl this process loaded (torch's CUDA build loads it at import), and whether
    it answers ``ncclGetVersion`` itself: a file found and loadable, not only a version that
    torch was built with."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/libnccl" in line]
    except OSError:
        paths = []
    if not paths:
        return {"library": None, "library_error": "no libnccl loaded by torch"}
    path = paths[0]
    try:
        code = ctypes.c_int()
        if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code)) != 0:
            return {"library": path, "library_error": "ncclGetVersion failed"}
    except OSError as exc:
        return {"library": path, "library_error": f"not loadable: {exc}"[:_REASON_CHARS]}
    major, rest = divmod(code.value, 10000)
    minor, patch = divmod(rest, 100)
    return {"library": path, "library_version": f"{major}.{minor}.{patch}"}


def _probe_tensorflow() -> Facts:
    out: Facts = {}
    # Keras shares the child: with its TensorFlow backend it imports TensorFlow anyway,
    # and a second multi-second import would only add load.
    try:
        if importlib.util.find_spec("tensorflow") is not None:
            import tensorflow as tf

            out["tensorflow"] = {"ok": True, "version": tf.__version__,
                                 "cuda": bool(tf.test.is_built_with_cuda()),
                                 "gpus": len(tf.config.list_physical_devices("GPU"))}
            if out["tensorflow"]["cuda"]:
                # the versions TensorFlow was built against; the ones loaded come from the
                # nvidia-* wheels (ddlrun.components reads those)
                info = tf.sysconfig.get_build_info()
                out["tensorflow"]["cuda_version"] = info.get("cuda_version")
                out["tensorflow"]["cudnn_version"] = info.get("cudnn_version")
    except Exception as exc:
        out["tensorflow"] = {"ok": False, "error": _reason(exc)}
    if importlib.util.find_spec("keras") is None:
        return out
    try:
        import keras

        if hasattr(keras, "config") and hasattr(keras.config, "backend"):
            backend = keras.config.backend()  # Keras 3: KERAS_BACKEND, else keras.json
        else:
            backend = keras.backend.backend()
        out["keras"] = {"ok": True, "version": keras.__version__, "backend": backend}
    except Exception as exc:
        out["keras"] = {"ok": False, "error": _reason(exc),
                        "backend": os.environ.get("KERAS_BACKEND")}
    return out


def _probe_mpi() -> Facts:
    try:
        import mpi4py

        # MPI_Get_library_version needs no MPI_Init: a probe must not start an MPI job
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        text = MPI.Get_library_version().replace("\x00", "").strip()
        major, minor = MPI.Get_version()
    except Exception as exc:
        return {"ok": False, "error": _reason(exc)}
    first = " ".join(text.splitlines()[0].split()) if text else ""
    return {"ok": True, "library": first.split(",")[0], "library_version": text,
            "standard": f"{major}.{minor}", "mpi4py": mpi4py.__version__}


# what each child probes, and the top-level packages it needs (none found: no child)
PROBES: dict[str, tuple[Callable[[], Facts], tuple[str, ...]]] = {
    "ddl": (_probe_ddl, ("ddl",)),
    "torch": (_probe_torch, ("torch",)),
    "tensorflow": (_probe_tensorflow, ("tensorflow", "keras")),
    "mpi": (_probe_mpi, ("mpi4py",)),
}

# the probe each requirement needs; ddl's (the header, /dev/shm) and MPI's (no MPI_Init,
# a fraction of a second) always run
_PROBE_OF = {"torch": "torch", "gloo": "torch", "nccl": "torch", "cuda": "torch",
             "gpu": "torch", "tensorflow": "tensorflow", "keras": "tensorflow"}
_ALWAYS = ("ddl", "mpi")


def probes_for(required: Sequence[str]) -> set[str]:
    """The probes ``--require`` needs: all of them without requirements (the whole
    report), else ddl's, MPI's and those of the required names."""
    if not required:
        return set(PROBES)
    return {*_ALWAYS, *(_PROBE_OF[name] for name in required if name in _PROBE_OF)}


# argv[2] is the folder holding this ddlrun package: the child runs this very module,
# even when the parent found ddlrun through a path the child's python lacks
_CHILD = ("import sys; sys.path.insert(0, sys.argv[2]); "
          "from ddlrun.check_probes import child_main; child_main(sys.argv[1])")


def child_main(name: str) -> None:
    """Run one probe and print its facts as one JSON line (the last line of stdout)."""
    facts = PROBES[name][0]()
    sys.stdout.flush()
    print(json.dumps(facts), flush=True)


def run_probe(name: str, timeout: float = PROBE_TIMEOUT,
              environ: Mapping[str, str] | None = None) -> Facts:
    """One probe in a child of this python: its facts, or ``{"error": why}``."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's start-up chatter
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, name, here], capture_output=True,
                             text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout:g} s (a hanging import?)"}
    except OSError as exc:
        return {"error": f"cannot run {sys.executable}: {exc.strerror}"}
    for line in reversed(out.stdout.splitlines()):
        with contextlib.suppress(ValueError):
            data = json.loads(line)
            if isinstance(data, dict):
                return data
    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"the probe exited {out.returncode}: {last}"[:_REASON_CHARS]}
