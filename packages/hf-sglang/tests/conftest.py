"""Fixtures: tiny model folders (built once), prompts, and one local Ray instance.

Engines start slowly on CPU (~40-90 s each on the 2-core machine), so every test module that
needs one shares a module-scoped engine; GPU-marked tests skip without CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).parent
GPU_REASON = "needs a CUDA GPU and SGLang's CUDA build (memory saver, nccl); none here"

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def sglang_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


needs_sglang = pytest.mark.skipif(
    not sglang_importable(), reason="SGLang is not installed (pip install 'hf-sglang[gpu]')"
)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    from hf_testing.ray_cluster import local_ray_cluster

    with local_ray_cluster([TESTS_DIR]):
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied Qwen2 (q/k/v biases, lm_head shared with the embedding), initializer_range 0.2."""
    from hf_testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return build_tiny_model(root / "qwen2_tied", "qwen2", tie_word_embeddings=True)


def encode(path: Path, texts: list[str]) -> dict[str, torch.Tensor]:
    """Left-padded token ids and mask for ``texts`` (the layout rollout engines take)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    return dict(tokenizer(texts, return_tensors="pt", padding=True))


def prompt_texts(count: int) -> list[str]:
    """Prompts of varied length and content (so left padding and outputs vary)."""
    kinds = [
        lambda i: f"reverse {i * 7919 % 100000}:",
        lambda i: f"{i * 37 % 1000}+{i * 53 % 100}=",
        lambda i: "".join("abcdefghij"[(i * k) % 10] for k in range(1, 2 + i % 6)),
        lambda i: f"Hello, World {i}!",
    ]
    return [kinds[i % len(kinds)](i) for i in range(count)]
