"""Fixtures: tiny model folders (built once per session) and one local Ray instance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf_testing.ray_cluster import local_ray_cluster

TESTS_DIR = Path(__file__).parent
GPU_REASON = "needs a CUDA GPU (nccl, bf16 mixed precision, offload); this machine has none"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    with local_ray_cluster([TESTS_DIR]):
        yield


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny model folders: both families, tied and untied, and the three head kinds."""
    from hf_testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2_tied": build_tiny_model(root / "qwen2_tied", "qwen2", tie_word_embeddings=True),
        "llama": build_tiny_model(root / "llama", "llama", seed=1),
        "value": build_tiny_model(root / "value", "llama", head="value", seed=2),
        "score": build_tiny_model(root / "score", "qwen2", head="score", seed=3),
    }
