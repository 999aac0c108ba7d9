"""Build the v1 recipes (recipe.yaml) with rattler-build, offline, from a local channel.

``make conda`` runs this file; tests/conda/test_conda.py calls its functions. rattler-build
(py-rattler-build, the Python API of the real tool) renders the recipe over
recipes/variants.yaml, builds it in its own isolated build/host environments, lays out the
``noarch: python`` package, and runs the recipe's ``tests:`` in a fresh test environment.
``load_from_file`` (pyproject.toml) is an experimental rattler-build feature: rendering here
always enables it, as ``rattler-build build --experimental`` does.

Offline, the host and test environments are solved from one local channel that
recipes/tools/local_channel.py makes: the stub python and, from PyPI wheels, exactly the
recipe's host and run requirements (python excepted) plus pip (rattler-build's python tests
run ``pip check``). The built packages are indexed with py-rattler (rattler_env.index_channel).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import local_channel  # noqa: E402  (sibling modules; this file also runs as a script)
import rattler_env  # noqa: E402

RECIPES = Path(__file__).resolve().parent.parent
VARIANTS = RECIPES / "variants.yaml"


def render(recipe: Path, variants: Path | None = VARIANTS, target_platform: str | None = None
           ) -> list[Any]:
    """rattler-build's rendered variants of ``recipe`` (a directory holding recipe.yaml)."""
    from rattler_build import PlatformConfig, RenderConfig, Stage0Recipe, VariantConfig

    stage0 = Stage0Recipe.from_file(Path(recipe) / "recipe.yaml")
    config = VariantConfig.from_file(variants) if variants else VariantConfig()
    platform = PlatformConfig(target_platform=target_platform, experimental=True)
    return stage0.render(config, RenderConfig(platform=platform))


def channel_requirements(rendered: Sequence[Any]) -> list[str]:
    """What the offline channel must hold for these variants: host + run + pip, as PEP 508."""
    wanted = {"pip": "pip"}
    for variant in rendered:
        reqs = variant.recipe.to_dict().get("requirements") or {}
        for spec in [*(reqs.get("host") or []), *(reqs.get("run") or [])]:
            name, _, constraint = str(spec).partition(" ")
            if name != "python":  # the stub python stands in for it
                wanted[name] = f"{name}{constraint.replace(' ', '')}"
    return sorted(wanted.values())


class _Log:
    """rattler-build's progress callback, kept as text (the build and test output included)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def on_download_start(self, event: Any) -> None:
        pass

    def on_download_progress(self, event: Any) -> None:
        pass

    def on_download_complete(self, event: Any) -> None:
        pass

    def on_build_step(self, event: Any) -> None:
        self.lines.append(f"[{event.step_name}] {event.message}")

    def on_log(self, event: Any) -> None:
        self.lines.append(f"{event.level}: {event.message}")


class BuildFailed(RuntimeError):
    """rattler-build failed; the message ends with the tail of its log."""


def build(recipe: Path, channel: Path, output_dir: Path, variants: Path | None = VARIANTS,
          test: bool = True, log_file: Path | None = None) -> list[Path]:
    """Build (and test) every variant of ``recipe`` against ``channel`` only; the packages."""
    from rattler_build import ToolConfiguration

    log = _Log()
    tool = ToolConfiguration(test_strategy="native" if test else "skip")
    packages: list[Path] = []
    try:
        for variant in render(recipe, variants):
            result = variant.run_build(tool_config=tool, output_dir=output_dir,
                                       channels=[channel.resolve().as_uri()],
                                       progress_callback=log)
            packages += result.packages
    except Exception as exc:
        raise BuildFailed(f"rattler-build {recipe}: {exc}\n" + "\n".join(log.lines[-80:])) from exc
    finally:
        if log_file is not None:
            log_file.write_text("\n".join(log.lines) + "\n")
    return packages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="build.py", description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="a recipe directory (holding recipe.yaml)")
    p.add_argument("--output-dir", default="build/conda-bld", help="where the packages go")
    p.add_argument("--channel", default="build/conda-local",
                   help="the offline channel made for the build and test environments")
    p.add_argument("--no-test", action="store_true", help="build only")
    args = p.parse_args(argv)
    recipe, out = Path(args.recipe).resolve(), Path(args.output_dir).resolve()
    channel = Path(args.channel).resolve()
    with tempfile.TemporaryDirectory(prefix="powerddl-conda-") as tmp:
        local_channel.make_channel(channel, channel_requirements(render(recipe)), Path(tmp))
    for pkg in build(recipe, channel, out, test=not args.no_test,
                     log_file=out / "build-log.txt"):
        print(f"built {pkg}")
    rattler_env.index_channel(out)
    print(f"indexed {out} (py-rattler); install with: conda install -c file://{out} powerddl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
