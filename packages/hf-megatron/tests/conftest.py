"""Fixtures: tiny model folders (built once per session) and one 4-rank group.

``ray_cluster`` comes from hf-testing's plugin; GPU tests skip without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hf_testing.gpu import skip_gpu_items
from hf_testing.tiny import LLAMA, QWEN2_TIED, build_tiny_models

GPU_REASON = "needs a CUDA GPU (nccl, Transformer Engine, bf16); this machine has none"
MODELS = {
    "qwen2_tied": QWEN2_TIED,
    "qwen2": {"family": "qwen2", "seed": 4},
    "llama": LLAMA,
    "llama_tied": {"family": "llama", "tie_word_embeddings": True, "seed": 5},
    "value": {"family": "qwen2", "head": "value", "seed": 2},
}
"""Both families, tied and untied, and a value model (plus ``odd_vocab``, see ``models``)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip_gpu_items(items, GPU_REASON)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """:data:`MODELS` and an odd vocabulary (real padding)."""
    from megatron_test_workers import build_odd_vocab_model

    root = tmp_path_factory.mktemp("models")
    built = build_tiny_models(root, MODELS)
    built["odd_vocab"] = build_odd_vocab_model(root / "odd_vocab", vocab_size=131)
    return built


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
