"""Render conda-build recipes (meta.yaml) for every variant, the way conda-build does.

Used by ``make conda`` where conda-build is not installed and by tests/conda/test_conda.py.
The order of the steps is conda-build's:

1. Variants: ``conda_build_config.yaml`` (itself selector-filtered) gives lists of values; a
   recipe is expanded over the keys it *uses* (named in a Jinja expression or a ``# [selector]``),
   one rendered recipe per combination, duplicates dropped.
2. Jinja2 with conda-build's context: ``environ``, ``os``, ``PYTHON``, ``PKG_HASH``,
   ``PKG_BUILDNUM``, every variant key, and ``load_file_data`` (toml/yaml/json; relative to
   the source directory, or to the recipe with ``from_recipe_dir=True``). Like conda-build it
   renders twice: first with the placeholders ``PKG_HASH=1234567``, ``PKG_BUILDNUM=0``, then
   with the real build number and a hash of the used variant values.
3. ``# [selector]`` lines: the expression is evaluated as Python over the variant namespace
   (``linux``, ``x86_64``, ``py`` = 311, ``py3k``, ``build_type``, ...); false lines are dropped.
4. YAML.

Not conda-build: the hash is a sha1 of the used variant values (conda-build hashes a slightly
different set of keys, so the hex differs); zip_keys, outputs:, pin_subpackage/compiler()
and recipe-append files are not implemented (no recipe here uses them: rendering fails if
one does).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

RECIPES = Path(__file__).resolve().parent.parent
CBC = RECIPES / "conda_build_config.yaml"

# conda-build's selector regex (metadata.py): text, then '# [expr]' at the end of the line.
_SELECTOR = re.compile(r"^(?P<text>.*?)\s*#\s*\[(?P<expr>[^\[\]]+)\]\s*$")
_JINJA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_JINJA_BLOCK = re.compile(r"\{\{(.*?)\}\}|\{%(.*?)%\}", re.S)
_STRING = re.compile(r"'[^']*'|\"[^\"]*\"")
PLACEHOLDER_HASH = "1234567"


class RenderError(Exception):
    """A recipe that does not render: the message names the recipe, the variant and the fix."""


@dataclass(frozen=True)
class Rendered:
    """One recipe rendered for one variant."""

    recipe_dir: Path
    variant: dict[str, str]  # the used keys only
    text: str  # after Jinja and selectors: what YAML parsed
    meta: dict[str, Any] = field(repr=False)

    @property
    def name(self) -> str:
        return str(self.meta["package"]["name"])

    @property
    def version(self) -> str:
        return str(self.meta["package"]["version"])

    @property
    def build(self) -> dict[str, Any]:
        return self.meta.get("build") or {}

    @property
    def build_number(self) -> int:
        return int(self.build.get("number", 0))

    @property
    def noarch(self) -> str | None:
        return self.build.get("noarch")

    @property
    def build_string(self) -> str:
        if "string" in self.build:
            return str(self.build["string"])
        if self.noarch == "python":  # conda-build's default for noarch python
            return f"py_{self.build_number}"
        return f"h{variant_hash(self.variant)}_{self.build_number}"

    @property
    def dist(self) -> str:
        return f"{self.name}-{self.version}-{self.build_string}"

    @property
    def skipped(self) -> bool:
        return bool(self.build.get("skip", False))

    def requirements(self, section: str) -> list[str]:
        return [str(r) for r in ((self.meta.get("requirements") or {}).get(section) or [])]


def platform_namespace(subdir: str | None = None) -> dict[str, Any]:
    """conda-build's ns_cfg platform names for ``subdir`` (default: this machine)."""
    if subdir is None:
        machine = platform.machine()
        osname = {"linux": "linux", "darwin": "osx", "win32": "win"}.get(sys.platform, "linux")
        arch = {"x86_64": "64", "AMD64": "64", "arm64": "arm64"}.get(machine, machine)
        subdir = f"{osname}-{arch}"
    osname, arch = subdir.split("-", 1)
    ns: dict[str, Any] = {
        "linux": osname == "linux", "osx": osname == "osx", "win": osname == "win",
        "unix": osname in ("linux", "osx"),
        "x86_64": arch == "64", "x86": arch in ("32", "64"), "ppc64le": arch == "ppc64le",
        "aarch64": arch == "aarch64", "arm64": arch == "arm64", "s390x": arch == "s390x",
        "target_platform": subdir, "build_platform": subdir, "subdir": subdir,
    }
    for name in ("linux", "osx", "win"):
        ns[f"{name}64"] = ns[name] and arch in ("64", "aarch64", "ppc64le", "arm64", "s390x")
        ns[f"{name}32"] = ns[name] and arch == "32"
    return ns


def select_lines(text: str, namespace: dict[str, Any], where: str = "") -> str:
    """Drop the lines whose ``# [expr]`` is false; strip the selector from the others."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        m = _SELECTOR.match(line)
        if m is None:
            out.append(line)
            continue
        try:
            keep = eval(m["expr"], {"__builtins__": {}}, dict(namespace))  # noqa: S307
        except Exception as exc:
            raise RenderError(f"{where}:{number}: selector [{m['expr']}] does not evaluate "
                              f"({exc}); selectors are Python over {sorted(namespace)}") from exc
        if keep:
            out.append(m["text"])
    return "\n".join(out) + "\n"


def selector_namespace(variant: dict[str, str], subdir: str | None = None) -> dict[str, Any]:
    ns = platform_namespace(subdir)
    ns.update({"os": os, "environ": os.environ})
    ns.update(variant)
    if "python" in variant:
        major, minor = variant["python"].split(".")[:2]
        ns.update(py=int(major + minor), py3k=major == "3", py2k=major == "2",
                  PY_VER=variant["python"])
    return ns


def load_config(path: Path = CBC, subdir: str | None = None) -> dict[str, list[str]]:
    """conda_build_config.yaml as {key: [values as strings]}, selectors applied."""
    text = select_lines(path.read_text(), platform_namespace(subdir), str(path))
    data = yaml.safe_load(text) or {}
    unsupported = {"zip_keys", "pin_run_as_build", "extend_keys"} & set(data)
    if unsupported:
        raise RenderError(f"{path}: {sorted(unsupported)} not implemented by this renderer")
    return {k: [str(v) for v in (vs if isinstance(vs, list) else [vs])] for k, vs in data.items()}


def used_keys(recipe_text: str, config: dict[str, list[str]]) -> list[str]:
    """Variant keys named in a Jinja expression/statement or a selector (conda-build's rule)."""
    names: set[str] = set()
    for expr, stmt in _JINJA_BLOCK.findall(recipe_text):
        names.update(_JINJA_NAME.findall(_STRING.sub("", expr or stmt)))
    for line in recipe_text.splitlines():
        m = _SELECTOR.match(line)
        if m:
            names.update(_JINJA_NAME.findall(_STRING.sub("", m["expr"])))
    return [k for k in config if k in names]


def variant_hash(variant: dict[str, str]) -> str:
    blob = json.dumps(variant, sort_keys=True).encode()
    return hashlib.sha1(blob).hexdigest()[:7]


def _source_dir(recipe_dir: Path, recipe_text: str) -> Path:
    m = re.search(r"^\s*path:\s*(\S+)\s*$", recipe_text, re.M)
    return (recipe_dir / m[1]).resolve() if m else recipe_dir


def _loader(recipe_dir: Path, source_dir: Path):
    def load_file_data(filename: str, file_type: str | None = None, *args,
                       from_recipe_dir: bool = False, **kwargs) -> Any:
        base = recipe_dir if from_recipe_dir else source_dir
        path = (base / filename).resolve()
        kind = file_type or path.suffix.lstrip(".")
        raw = path.read_bytes()
        if kind == "toml":
            return tomllib.loads(raw.decode())
        if kind in ("yaml", "yml"):
            return yaml.safe_load(raw)
        if kind == "json":
            return json.loads(raw)
        raise RenderError(f"load_file_data({filename!r}): unknown file type {kind!r}")

    def unsupported(name: str):
        def fail(*args, **kwargs):
            raise RenderError(f"{recipe_dir}: {name}() is not implemented by this renderer")
        return fail

    return {"load_file_data": load_file_data,
            "load_setup_py_data": unsupported("load_setup_py_data"),
            "compiler": unsupported("compiler"), "pin_compatible": unsupported("pin_compatible"),
            "pin_subpackage": unsupported("pin_subpackage")}


def _render_once(recipe_dir: Path, template: str, variant: dict[str, str], full: dict[str, str],
                 python: str, pkg_hash: str, buildnum: str, subdir: str | None) -> Rendered:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    context: dict[str, Any] = dict(full)
    context.update(_loader(recipe_dir, _source_dir(recipe_dir, template)))
    context.update(environ=os.environ, os=os, PYTHON=python, PKG_HASH=pkg_hash,
                   PKG_BUILDNUM=buildnum, RECIPE_DIR=str(recipe_dir))
    if "python" in full:
        context.update(PY_VER=full["python"], CONDA_PY=full["python"].replace(".", ""))
    where = str(recipe_dir / "meta.yaml")
    try:
        text = env.from_string(template).render(**context)
    except jinja2.TemplateError as exc:
        raise RenderError(f"{where} (variant {variant}): Jinja: {exc}") from exc
    text = select_lines(text, selector_namespace(full, subdir), where)
    try:
        meta = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise RenderError(f"{where} (variant {variant}): YAML after Jinja and selectors: "
                          f"{exc}") from exc
    return Rendered(recipe_dir, variant, text, meta)


def render(recipe_dir: str | Path, config: dict[str, list[str]] | None = None,
           python: str = "python", subdir: str | None = None) -> list[Rendered]:
    """Every variant of one recipe (skipped ones included: check ``.skipped``)."""
    recipe_dir = Path(recipe_dir).resolve()
    config = load_config(subdir=subdir) if config is None else config
    template = (recipe_dir / "meta.yaml").read_text()
    keys = used_keys(template, config)
    results: dict[str, Rendered] = {}
    for values in itertools.product(*(config[k] for k in keys)):
        variant = dict(zip(keys, values))
        full = {k: v[0] for k, v in config.items()} | variant
        first = _render_once(recipe_dir, template, variant, full, python, PLACEHOLDER_HASH, "0",
                             subdir)
        final = _render_once(recipe_dir, template, variant, full, python, variant_hash(variant),
                             str(first.build_number), subdir)
        results.setdefault(final.dist, final)  # conda-build drops identical outputs too
    return list(results.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="render.py", description=__doc__.splitlines()[0])
    p.add_argument("recipes", nargs="+", help="recipe directories (holding meta.yaml)")
    p.add_argument("-m", "--variant-config", default=str(CBC), help="conda_build_config.yaml")
    p.add_argument("--subdir", help="target platform, e.g. linux-64 (default: this machine)")
    p.add_argument("--show", action="store_true", help="print each rendered meta.yaml")
    args = p.parse_args(argv)
    config = load_config(Path(args.variant_config), args.subdir)
    for recipe in args.recipes:
        for r in render(recipe, config, subdir=args.subdir):
            state = "skip" if r.skipped else (r.noarch and f"noarch:{r.noarch}" or "arch")
            print(f"{r.dist:60s} {state:15s} {json.dumps(r.variant)}")
            if args.show:
                print(r.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
