"""``make matrix``: the core, torch and TensorFlow tests against the oldest and the newest
release of the supported range (``[tool.powerddl.supported]`` in pyproject.toml), each end
in its own venv (``.venv-matrix/<end>``), then one markdown table (docs/install.md's).

    python tools/matrix.py [--ends oldest,newest] [--pytest-args "-m 'not slow'"]

A venv is made once and reused while its pins are unchanged (a stamp file holds them). The
newest end is what pyproject's extras pin, which the README's commands install.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TESTS = ("tests/core", "tests/torch", "tests/tensorflow")
ENDS = ("oldest", "newest")
# powerddl's extras in each venv: all but the frameworks' (pinned per end here) and the
# clients' (Lightning, Accelerate, Transformers: their own version ranges)
EXTRAS = "mpi,examples,perf,dev"
# what the ddl.tensorflow extra adds besides TensorFlow and Keras (pyproject's tensorflow)
TF_EXTRAS = ("cloudpickle>=3", "ml_dtypes>=0.5")


def supported(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, tuple[str, str]]:
    """package -> (oldest, newest), from ``[tool.powerddl.supported]``."""
    table = tomllib.loads(pyproject.read_text())["tool"]["powerddl"]["supported"]
    return {name: (ends[0], ends[1]) for name, ends in table.items()}


def pins(end: str, pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The requirement strings of one end of the range."""
    index = ENDS.index(end)
    return [f"{name}=={ends[index]}" for name, ends in supported(pyproject).items()]


def _venv(end: str, reqs: list[str], log) -> Path:
    env = ROOT / ".venv-matrix" / end
    py = env / "bin" / "python"
    stamp = env / ".matrix-pins"
    want = json.dumps([EXTRAS, reqs])
    if stamp.exists() and stamp.read_text() == want:
        return py
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    steps = ([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"],
             [str(py), "-m", "pip", "install", "-q", "-e", f"{ROOT}[{EXTRAS}]",
              *reqs, *TF_EXTRAS])
    for argv in steps:
        print("+", shlex.join(argv), file=log, flush=True)
        subprocess.run(argv, check=True)
    stamp.write_text(want)
    return py


def _versions(py: Path) -> dict[str, str]:
    code = ("import json, importlib.metadata as m\n"
            "out = {}\n"
            "for n in ('torch', 'tensorflow-cpu', 'keras', 'numpy'):\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = '-'\n"
            "print(json.dumps(out))")
    return json.loads(subprocess.run([str(py), "-c", code], capture_output=True, text=True,
                                     check=True).stdout)


def summary_counts(text: str) -> dict[str, int]:
    """pytest's last line ('3 failed, 120 passed, 4 skipped in 9.1s') as counts."""
    tail = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)",
                                   tail[-1] if tail else ""):
        counts["error" if word.startswith("error") else word] += int(number)
    return counts


def run_end(end: str, pytest_args: list[str], log) -> dict:
    reqs = pins(end)
    py = _venv(end, reqs, log)
    t0 = time.monotonic()
    argv = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, *TESTS]
    print("+", shlex.join(argv), file=log, flush=True)
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    (ROOT / ".venv-matrix" / f"{end}.log").write_text(out.stdout + out.stderr)
    return {"end": end, **_versions(py), **summary_counts(out.stdout),
            "minutes": round((time.monotonic() - t0) / 60, 1), "exit": out.returncode}


def table(rows: list[dict]) -> str:
    lines = ["| end | torch | TensorFlow | Keras | NumPy | passed | failed | skipped | "
             "minutes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['end']} | {r['torch']} | {r['tensorflow-cpu']} | {r['keras']} | "
                     f"{r['numpy']} | {r['passed']} | {r['failed'] + r['error']} | "
                     f"{r['skipped']} | {r['minutes']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/matrix.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--ends", default=",".join(ENDS), help="oldest, newest or both")
    p.add_argument("--pytest-args", default="", help="more pytest arguments, one string")
    args = p.parse_args(argv)
    rows = [run_end(end, shlex.split(args.pytest_args), sys.stderr)
            for end in args.ends.split(",")]
    print(table(rows))
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
