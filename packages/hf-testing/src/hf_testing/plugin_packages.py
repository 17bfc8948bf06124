"""Third-party plugin packages built and pip-installed in a test, the way users ship them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from hf_core.plugins import ENTRY_POINT_GROUP


def install_plugin_package(
    tmp: Path,
    dist: str,
    module: str,
    source: str,
    target: Path,
    groups: tuple[str, ...] = (ENTRY_POINT_GROUP,),
) -> Path:
    """Build distribution ``dist`` whose package ``module`` holds ``plugin.py`` = ``source``
    and whose entry point, in each of ``groups`` (``hybridflow.plugins``; the deprecated old
    name to test its warning), names it, and ``pip install`` it into ``target`` (a folder to
    put on ``sys.path`` / ``PYTHONPATH``).  Returns ``target``."""
    project = tmp / dist
    (project / module).mkdir(parents=True)
    (project / module / "__init__.py").write_text("")
    (project / module / "plugin.py").write_text(source)
    entry_points = "".join(
        f'[project.entry-points."{group}"]\n{module} = "{module}.plugin"\n\n' for group in groups
    )
    (project / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist}"
            version = "0.3.1"

            [tool.setuptools]
            packages = ["{module}"]
            """
        )
        + "\n"
        + entry_points
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(project),
        ],
        check=True,
    )
    return target


LIGHT_ENGINE_PLUGIN = """
from pydantic import BaseModel, ConfigDict

from hf_core.plugins import hookimpl


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    head: str = "lm"
    trainable: bool = True
    seed: int = 0
    lr: float = 1e-6


class RolloutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str


def build(**config):
    raise RuntimeError("the checks never build an engine")


@hookimpl
def register_training_engines(register):
    register("stub-train", build, config="{module}.plugin:TrainSettings")


@hookimpl
def register_rollout_engines(register):
    register("stub-rollout", build, config="{module}.plugin:RolloutSettings")
"""
"""A plugin registering engines ``stub-train`` and ``stub-rollout`` whose settings models import
only pydantic: what the recipe checks cost without a backend's own imports."""


def write_light_engine_plugin(site: Path, module: str) -> Path:
    """:data:`LIGHT_ENGINE_PLUGIN` as package ``module`` in folder ``site``, with the dist-info
    naming its entry point as an installer leaves them (no pip: the CLI checks read it as
    installed).  Returns ``site``."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text("")
    (site / module / "plugin.py").write_text(LIGHT_ENGINE_PLUGIN.replace("{module}", module))
    dist = module.replace("_", "-")
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nstub = {module}.plugin\n")
    return site


def env_with_site(site: Path) -> dict[str, str]:
    """This process's environment with ``site`` first on ``PYTHONPATH``, for a child that must
    see the packages installed there (``hybridflow backends``, ``hybridflow run``): no
    ``RAY_ADDRESS`` (a run starts its own Ray, whose workers inherit the path) and a wide
    console for the plugin table."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *inherited]), COLUMNS="240")
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    return env
