"""End-to-end fixtures: tiny assets built once, one Ray instance for every recipe run."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from hf_testing.ray_cluster import local_ray_cluster

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"


def load_script(path: Path) -> ModuleType:
    """A script of the repository (``recipes/*.py``, ``faults/*.py``) as a module, registered
    under its file name: its dataclasses look their module up in ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _load_make_assets():
    return load_script(RECIPES / "make_assets.py").make_assets


POST_TRAINING = ("sft", "reward_model", "dpo")
"""The recipes of the supervised and preference trainers (``trainer:`` other than rl)."""

FLOAT32_ROLLOUT = "rollout.engine.dtype=float32"
"""For runs whose checks need float32 rollouts (rollout and training log-probs equal up to
summation order): the transformers engine's default ``dtype: auto`` is bfloat16 on CPUs that compute
it (AMX, AVX512-BF16), where those checks would measure rounding instead."""

LONG = pytest.mark.long
"""A longer variant of what a default test already checks (another layout, another resume
point, a fault healed rather than reported): ``nox -s e2e_long`` runs these, ``nox -s e2e``
(the default matrix) does not, to keep CI within its time."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: longer variant, run by `nox -s e2e_long` only")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding runs/assets, as recipes expect when run from the repository root."""
    folder = tmp_path_factory.mktemp("e2e")
    _load_make_assets()(folder / "runs" / "assets")
    return folder


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    with local_ray_cluster():
        yield


@pytest.fixture
def in_workdir(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(workdir)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    return workdir


def stable_metrics(row: dict, volatile: tuple[str, ...]) -> dict:
    """A metrics row without the keys that legitimately differ between equal runs (times,
    memory, ...): what exactness tests compare."""
    return {k: v for k, v in row.items() if not k.startswith(volatile)}


def exported_weights(out: Path, folder: str = "actor_hf") -> dict:
    """Every tensor of the HF export (``run.export_final``) of the run in ``out``: the actor's,
    or another trained role's ``folder`` (``reward_hf``)."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted((out / folder).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def logged_step_reached(output_dir: Path, step: int) -> bool:
    """Whether a run's metrics.jsonl already has a row of ``step`` or later (fault tests wait
    for it before killing a worker)."""
    try:
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return False
    return any(json.loads(line)["step"] >= step for line in lines if line.strip())
