"""Run one of Horovod's own test files against ddl, unchanged, and print what each rank saw.

Horovod's test files import `horovod.<framework>` and three helpers from Horovod's
`test/common.py`. This script builds both in a fresh temp dir, written by us: an alias
package (`horovod/torch/__init__.py` that hands every attribute to `ddl.torch`, and so on)
and a `common.py` with our own `mpi_env_rank_and_size`, `skip_or_fail_gpu_test` and
`temppath`. It then runs the file under ddlrun, either one job per test (`--isolated`) or
the whole file in one job (`--one-job`, as Horovod's CI runs it: no shutdown between tests,
so a test that leaves the ranks out of step shows up in the tests after it). A small pytest
plugin of ours writes each rank's outcome per test as it happens, so a job killed by its
timeout still reports what ran, and which test it was stuck in.

Horovod's files are read from where they lie (keep them outside this repository); nothing
of them is copied. Commands used for docs/pytorch.md and docs/tensorflow.md:

    .venv/bin/python benchmarks/horovod_tests.py /tmp/hvd/test_torch.py \\
        --alias horovod.torch=ddl.torch -n 2 --isolated
    .venv/bin/python benchmarks/horovod_tests.py /tmp/hvd/test_torch.py \\
        --alias horovod.torch=ddl.torch -n 2 --one-job
    .venv/bin/python benchmarks/horovod_tests.py /tmp/hvd/test_torch.py \\
        --alias horovod.torch=ddl.torch -n 3 --one-job
    .venv/bin/python benchmarks/horovod_tests.py /tmp/hvd/test_tensorflow.py \\
        --alias horovod.tensorflow=ddl.tensorflow \\
        --alias horovod.tensorflow.keras=ddl.keras -n 2 --isolated
    .venv/bin/python benchmarks/horovod_tests.py /tmp/hvd/test_tensorflow2_keras.py \\
        --alias horovod.tensorflow.keras=ddl.keras --alias horovod.keras=ddl.keras \\
        --alias horovod.tensorflow=ddl.tensorflow -n 2 --one-job

`--alias` may be repeated (any dotted name to any importable module; parents of the
alias are created as empty packages). `-k EXPR` selects tests as pytest's `-k` does.
`--timeout` is per job: per test with `--isolated` (default 180 s), for the whole file
with `--one-job` (default 3600 s); `--test-timeout` is pytest-timeout's per test (default
300 s in one job, so a test that hangs fails and the job goes on to the next one).
`--json PATH` writes the same results as JSON, with each rank's full failure message.

Output: one row per test with each rank's outcome (passed, failed, skipped; `hung` when
the rank started the test and the job ended before it finished; `-` when the rank never
reached it), then totals per rank and overall (a test passes overall when no rank failed
and at least one passed). The job logs stay under the printed work dir. Exit status: 0
when every test passed or skipped, 1 when one failed, hung or never ran, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

_ALIAS_MODULE = '''"""Alias written by benchmarks/horovod_tests.py: {alias} -> {target}."""
import importlib as _importlib

_target = _importlib.import_module("{target}")
__all__ = list(getattr(_target, "__all__", [n for n in dir(_target) if not n.startswith("_")]))


def __getattr__(name):
    return getattr(_target, name)


def __dir__():
    return sorted(set(globals()) | set(dir(_target)))
'''

# Our own versions of the three helpers Horovod's test files import from test/common.py.
_COMMON_MODULE = '''"""Helpers for Horovod's test files, written by benchmarks/horovod_tests.py."""
import contextlib
import os
import shutil
import tempfile


def mpi_env_rank_and_size():
    """(rank, size) from an MPI launcher's env, or (0, 1) when there is none."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    """Skip a GPU test, or fail it when HOROVOD_TEST_GPU=1 says GPUs must be there."""
    if os.environ.get("HOROVOD_TEST_GPU") == "1":
        test.fail(message)
    test.skipTest(message)


@contextlib.contextmanager
def temppath():
    """A fresh path that does not exist yet; whatever is made there is removed after."""
    parent = tempfile.mkdtemp()
    try:
        yield os.path.join(parent, "p")
    finally:
        shutil.rmtree(parent, ignore_errors=True)
'''

# pytest plugin: one JSON line per test start and finish, per rank, flushed at once.
_REPORT_PLUGIN = '''"""Per-rank pytest outcomes as they come, by benchmarks/horovod_tests.py."""
import json
import os

_rank = os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0"))
_out = open(os.path.join(os.environ["DDL_HVD_REPORT_DIR"], "rank%s.jsonl" % _rank), "a")
_seen = {}


def _write(record):
    _out.write(json.dumps(record) + "\\n")
    _out.flush()


def _reason(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return (crash.message or "")[:2000]
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2])[:2000]
    return str(report.longrepr or "")[-2000:]


def pytest_runtest_logstart(nodeid, location):
    _seen[nodeid] = None
    _write({"test": nodeid, "event": "start"})


def pytest_runtest_logreport(report):
    first = _seen.get(report.nodeid)
    if report.failed and (first is None or first[0] != "failed"):
        _seen[report.nodeid] = ("failed", _reason(report))
    elif report.skipped and first is None:
        _seen[report.nodeid] = ("skipped", _reason(report))
    elif report.when == "call" and report.passed and first is None:
        _seen[report.nodeid] = ("passed", "")


def pytest_runtest_logfinish(nodeid, location):
    outcome, reason = _seen.get(nodeid) or ("passed", "")
    _write({"test": nodeid, "event": "finish", "outcome": outcome, "reason": reason})


def pytest_unconfigure(config):
    _out.close()
'''

OUTCOMES = ("passed", "failed", "skipped", "hung", "-")


@dataclass(frozen=True)
class Alias:
    """`name=target`: `import name` gives every attribute of `target`."""

    name: str
    target: str


@dataclass
class TestResult:
    """One test's outcome on each rank (rank -> outcome), with the first failure's reason."""

    test: str
    per_rank: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)

    def first_cause(self) -> str:
        """The first line of a failure that is not only a peer's failure seen from here
        (DDLPeerError: another rank failed first), else of any failure."""
        lines = [r.splitlines()[0] for r in self.reasons.values() if r]
        own = [line for line in lines if "DDLPeerError" not in line]
        return (own or lines or [""])[0]

    def overall(self) -> str:
        """failed/hung if any rank was; passed if any passed; skipped if all skipped."""
        seen = set(self.per_rank.values())
        for outcome in ("failed", "hung", "passed", "skipped"):
            if outcome in seen:
                return outcome
        return "-"


def parse_alias(text: str) -> Alias:
    """`horovod.torch=ddl.torch` -> Alias; argparse type."""
    name, sep, target = text.partition("=")
    parts = name.split(".")
    if not sep or not target or not all(p.isidentifier() for p in parts + target.split(".")):
        raise argparse.ArgumentTypeError(
            f"--alias {text!r}: expected DOTTED.NAME=DOTTED.TARGET, e.g. horovod.torch=ddl.torch")
    return Alias(name, target)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run a Horovod test file against ddl through a module alias.")
    parser.add_argument("test_file", type=Path,
                        help="path of Horovod's test file (outside the repo)")
    parser.add_argument("--alias", type=parse_alias, action="append", required=True,
                        help="horovod.X=ddl.Y (repeat for more)")
    parser.add_argument("-n", "--ranks", type=int, default=2, help="ranks per job (default 2)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--isolated", action="store_true", help="one ddlrun job per test")
    mode.add_argument("--one-job", action="store_true", help="the whole file in one ddlrun job")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per job (default 180 isolated, 3600 one job)")
    parser.add_argument("--test-timeout", type=float, default=None,
                        help="seconds per test, pytest-timeout's (default: the job's "
                             "timeout isolated, 300 in one job)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the alias, helpers and logs go (default: a new temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    return parser


def write_support(workdir: Path, aliases: Sequence[Alias]) -> Path:
    """Write the alias packages, common.py and the report plugin; return the PYTHONPATH dir."""
    root = workdir / "support"
    root.mkdir(parents=True, exist_ok=True)
    for alias in aliases:
        parts = alias.name.split(".")
        for depth in range(1, len(parts)):
            init = root.joinpath(*parts[:depth], "__init__.py")
            init.parent.mkdir(parents=True, exist_ok=True)
            if not init.exists():
                init.write_text("")
        package = root.joinpath(*parts)
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(
            _ALIAS_MODULE.format(alias=alias.name, target=alias.target))
    (root / "common.py").write_text(_COMMON_MODULE)
    (root / "ddl_hvd_report.py").write_text(_REPORT_PLUGIN)
    return root


def job_env(support: Path, report_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(support), env.get("PYTHONPATH", "")) if p)
    env["DDL_HVD_REPORT_DIR"] = str(report_dir)
    return env


def pytest_argv(test_file: Path, selection: Sequence[str], timeout: float) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
            "-p", "ddl_hvd_report", f"--rootdir={test_file.parent}",
            f"--timeout={int(timeout)}", *selection]


def collect(test_file: Path, support: Path, keyword: str | None, workdir: Path) -> list[str]:
    """The test ids pytest collects from the file (one process, no job)."""
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
            f"--rootdir={test_file.parent}", test_file.name]
    if keyword:
        argv += ["-k", keyword]
    done = subprocess.run(argv, cwd=test_file.parent, env=job_env(support, workdir),
                          capture_output=True, text=True, timeout=600, check=False)
    tests = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if not tests:
        raise SystemExit(f"no tests collected from {test_file}:\n{done.stdout}{done.stderr}")
    return tests


def run_job(argv: list[str], cwd: Path, env: dict[str, str], timeout: float,
            log: Path) -> int:
    """Run one ddlrun job; past its timeout, SIGTERM ddlrun (it tears its ranks down),
    then SIGKILL the process group we started it in."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait()


def ddlrun_argv(ranks: int, timeout: float, program: list[str]) -> list[str]:
    return [sys.executable, "-m", "ddlrun", "-n", str(ranks), "--timeout", str(int(timeout)),
            *program]


def read_reports(report_dir: Path, results: dict[str, TestResult], ranks: int) -> None:
    """Fold each rank's jsonl into results: finished -> outcome, started only -> hung."""
    for rank in range(ranks):
        path = report_dir / f"rank{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            record = json.loads(line)
            result = results.setdefault(record["test"], TestResult(record["test"]))
            if record["event"] == "start":
                result.per_rank[rank] = "hung"
            else:
                result.per_rank[rank] = record["outcome"]
                if record["reason"]:
                    result.reasons[rank] = record["reason"]


def run(args: argparse.Namespace) -> dict[str, TestResult]:
    test_file = args.test_file.resolve()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ddl-hvd-tests-"))
    workdir = workdir.resolve()
    support = write_support(workdir, args.alias)
    tests = collect(test_file, support, args.keyword, workdir)
    results = {test: TestResult(test) for test in tests}
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    print(f"# work dir: {workdir}  ({len(tests)} tests, {args.ranks} ranks, "
          f"{'isolated' if args.isolated else 'one job'})", flush=True)
    if args.isolated:
        timeout = args.timeout or 180.0
        for index, test in enumerate(tests):
            report_dir = workdir / "reports" / f"{index:04d}"
            report_dir.mkdir(parents=True, exist_ok=True)
            argv = ddlrun_argv(args.ranks, timeout, pytest_argv(
                test_file, [test], args.test_timeout or timeout))
            run_job(argv, test_file.parent, job_env(support, report_dir), timeout,
                    logs / f"{index:04d}.log")
            read_reports(report_dir, results, args.ranks)
            print(f"#  {test.rsplit('::', 1)[-1]}: {results[test].overall()}", flush=True)
    else:
        timeout = args.timeout or 3600.0
        report_dir = workdir / "reports" / "one-job"
        report_dir.mkdir(parents=True, exist_ok=True)
        selection = tests if args.keyword else [test_file.name]
        argv = ddlrun_argv(args.ranks, timeout, pytest_argv(
            test_file, selection, args.test_timeout or 300.0))
        run_job(argv, test_file.parent, job_env(support, report_dir), timeout,
                logs / "one-job.log")
        read_reports(report_dir, results, args.ranks)
    return results


def format_table(results: dict[str, TestResult], ranks: int) -> str:
    """Per-test rows (one column per rank, then overall), then totals."""
    width = max(len(t.rsplit("::", 1)[-1]) for t in results) + 2
    header = "test".ljust(width) + "".join(f"rank{r}".ljust(9) for r in range(ranks)) + "overall"
    lines = [header, "-" * len(header)]
    for result in results.values():
        row = result.test.rsplit("::", 1)[-1].ljust(width)
        row += "".join(result.per_rank.get(r, "-").ljust(9) for r in range(ranks))
        row += result.overall()
        reason = result.first_cause() if result.overall() != "passed" else ""
        lines.append(row + (f"   {reason[:120]}" if reason and result.overall() != "skipped"
                            else ""))
    lines.append("")
    lines.append("totals".ljust(width) + "  ".join(OUTCOMES))
    for column in [*range(ranks), "overall"]:
        outcomes = [r.overall() if column == "overall" else r.per_rank.get(column, "-")
                    for r in results.values()]
        label = "overall" if column == "overall" else f"rank{column}"
        counts = "  ".join(f"{outcomes.count(o):>{len(o)}}" for o in OUTCOMES)
        lines.append(label.ljust(width) + counts)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.test_file.is_file():
        print(f"no such test file: {args.test_file}", file=sys.stderr)
        return 2
    if args.ranks < 1:
        print(f"-n {args.ranks}: need at least one rank", file=sys.stderr)
        return 2
    results = run(args)
    print(format_table(results, args.ranks))
    if args.json:
        args.json.write_text(json.dumps(
            {t: {"per_rank": r.per_rank, "overall": r.overall(), "reasons": r.reasons}
             for t, r in results.items()}, indent=1))
    bad = [r for r in results.values() if r.overall() in ("failed", "hung", "-")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
