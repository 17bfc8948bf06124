"""The pytest plugin every HybridFlow test suite gets (entry point ``pytest11: hf_testing``).

It registers the ``gpu`` marker and provides session fixtures a conftest may override:
``ray_cluster`` (one private local Ray instance), ``models`` (the standard tiny model
folders) and ``vlm`` (a tiny vision-language model and its task).  Imports stay inside the
fixtures: the plugin loads in every pytest run of a venv that has hf-testing, and must not
start Ray or import transformers there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line(
        "markers",
        "serial: checks state of the whole machine (its processes, cgroups), so it runs after "
        "the pytest-xdist workers, alone",
    )


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    """A local Ray instance whose workers can import the modules next to the collected tests
    (test-only worker classes such as ``fsdp_test_workers``)."""
    from hf_testing.ray_cluster import local_ray_cluster

    test_dirs = sorted({item.path.parent for item in request.session.items})
    with local_ray_cluster(test_dirs):
        yield


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny model folders built once per session: :data:`hf_testing.tiny.STANDARD_MODELS`."""
    from hf_testing.tiny import STANDARD_MODELS, build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("models"), STANDARD_MODELS)


@pytest.fixture(scope="session")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Qwen2-VL folder and the count-the-squares task, built once per session:
    ``{"model": folder, "train": jsonl}`` (:mod:`hf_testing.tiny_vlm`,
    :mod:`hf_testing.visual_task`)."""
    from hf_testing.tiny_vlm import build_tiny_vlm
    from hf_testing.visual_task import write_count_task

    root = tmp_path_factory.mktemp("vlm")
    return {
        "model": build_tiny_vlm(root / "model"),
        "train": write_count_task(root / "data", n=32, seed=0),
    }
