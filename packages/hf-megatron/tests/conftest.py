"""Fixtures: tiny model folders (built once per session), one local Ray, one 4-rank group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf_testing.ray_cluster import local_ray_cluster

TESTS_DIR = Path(__file__).parent
GPU_REASON = "needs a CUDA GPU (nccl, Transformer Engine, bf16); this machine has none"


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
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both families, tied and untied, a value model, and an odd vocabulary (real padding)."""
    from megatron_test_workers import build_odd_vocab_model

    from hf_testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2_tied": build_tiny_model(root / "qwen2_tied", "qwen2", tie_word_embeddings=True),
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", seed=4),
        "llama": build_tiny_model(root / "llama", "llama", seed=1),
        "llama_tied": build_tiny_model(
            root / "llama_tied", "llama", tie_word_embeddings=True, seed=5
        ),
        "value": build_tiny_model(root / "value", "qwen2", head="value", seed=2),
        "odd_vocab": build_odd_vocab_model(root / "odd_vocab", vocab_size=131),
    }


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    with local_ray_cluster([TESTS_DIR]):
        yield


@pytest.fixture(scope="session")
def group(ray_cluster: None) -> Iterator:
    """Four ranks (gloo), shared by every Ray test: engines are built and dropped per test."""
    from megatron_test_workers import MegatronWorker

    from hf_core.runtime import ResourcePool, spawn

    pool = ResourcePool([4], name="megatron_4")
    workers = spawn(pool, {"megatron": MegatronWorker}, failure_timeout_s=120.0)["megatron"]
    yield workers
    workers.shutdown()
    pool.release()
