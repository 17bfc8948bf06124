"""Fixtures: vLLM's environment, tiny model folders (built once) and one local Ray instance.

vLLM's CPU backend reserves ~11 GiB of KV cache and starts in ~100 s unless
``VLLM_CPU_KVCACHE_SPACE`` is set; hybrid mode needs the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``).  Both are set here, before Ray starts, so the worker
processes inherit them too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
for _key, _value in VLLM_ENV.items():
    os.environ.setdefault(_key, _value)

TESTS_DIR = Path(__file__).parent
GPU_REASON = "needs a CUDA GPU and vLLM's CUDA build (sleep mode is CUDA-only); none here"

# The CPU attention kernels of vllm-cpu need head_dim >= 32: hidden 128 / 4 heads.
TINY = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2}


MEASUREMENTS: list[tuple[str, str]] = []
"""What tests measured (log-prob gaps, sync times), printed at the end of every run."""


@pytest.fixture
def report() -> Callable[[str, object], None]:
    """``report(name, value)``: print now and list in the run's closing summary."""

    def record(name: str, value: object) -> None:
        text = f"{value:.3g}" if isinstance(value, float) else str(value)
        print(f"{name}: {text}")
        MEASUREMENTS.append((name, text))

    return record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if MEASUREMENTS:
        terminalreporter.section("hf-vllm measurements")
        for name, text in MEASUREMENTS:
            terminalreporter.write_line(f"{name}: {text}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    from hf_testing.ray_cluster import local_ray_cluster

    with local_ray_cluster([TESTS_DIR]):
        yield


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tied Qwen2 (q/k/v biases, lm_head shared with the embedding) and an untied Llama."""
    from hf_testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2_tied": build_tiny_model(
            root / "qwen2_tied", "qwen2", tie_word_embeddings=True, **TINY
        ),
        "llama": build_tiny_model(root / "llama", "llama", seed=1, **TINY),
    }


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
