"""Fixtures: a tiny model folder (built once); ``ray_cluster`` comes from hf-testing's plugin.

Engines start slowly on CPU (~40-90 s each on the 2-core machine), so every test module that
needs one shares a module-scoped engine; GPU-marked tests skip without CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hf_testing.gpu import skip_gpu_items

GPU_REASON = "needs a CUDA GPU and SGLang's CUDA build (memory saver, nccl); none here"

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip_gpu_items(items, GPU_REASON)


def sglang_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


needs_sglang = pytest.mark.skipif(
    not sglang_importable(), reason="SGLang is not installed (pip install 'hf-sglang[gpu]')"
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied Qwen2 (q/k/v biases, lm_head shared with the embedding), initializer_range 0.2."""
    from hf_testing.tiny import QWEN2_TIED, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen2_tied", **QWEN2_TIED)
