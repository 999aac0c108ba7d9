"""The core's layers (pyproject.toml's import-linter contracts) hold, imports inside
functions included: the contracts are checked here so that CI fails when one breaks."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lint_imports() -> str:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.fail("lint-imports is missing: make install puts import-linter into .venv")
    return exe


def test_the_import_contracts_hold():
    out = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_a_broken_layer_is_reported(tmp_path):
    """The check can fail: a copy of the core whose timeline imports api breaks it."""
    src = os.path.join(ROOT, "ddl-core", "ddl")
    pkg = tmp_path / "ddl"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__", "perf", "torch",
                                                             "tensorflow", "keras", "hvd"))
    with open(pkg / "timeline.py", "a") as f:
        f.write("\n\ndef _upward():\n    from . import api  # noqa: F401\n")
    (tmp_path / "setup.cfg").write_text(
        "[importlinter]\nroot_package = ddl\n\n[importlinter:contract:1]\nname = layers\n"
        "type = layers\nlayers =\n    ddl.api\n    ddl.runtime\n    ddl.timeline\n")
    out = subprocess.run([_lint_imports(), "--no-cache", "--config", "setup.cfg"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode != 0, out.stdout
    assert "ddl.timeline is not allowed to import ddl.api" in out.stdout, out.stdout
