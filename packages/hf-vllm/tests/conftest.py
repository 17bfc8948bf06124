"""Fixtures: vLLM's environment and tiny model folders (built once); ``ray_cluster`` comes from
hf-testing's plugin.

vLLM's CPU backend reserves ~11 GiB of KV cache and starts in ~100 s unless
``VLLM_CPU_KVCACHE_SPACE`` is set; hybrid mode needs the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``).  Both are set here, before Ray starts, so the worker
processes inherit them too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hf_testing.gpu import skip_gpu_items

VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
for _key, _value in VLLM_ENV.items():
    os.environ.setdefault(_key, _value)

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


def run_engine_child(script: str, *args: str) -> dict:
    """``script`` in a child interpreter (a ``vllm.LLM`` built in the test process would stay
    there); the ``RESULT <json>`` it printed last."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if MEASUREMENTS:
        terminalreporter.section("hf-vllm measurements")
        for name, text in MEASUREMENTS:
            terminalreporter.write_line(f"{name}: {text}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip_gpu_items(items, GPU_REASON)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tied Qwen2 (q/k/v biases, lm_head shared with the embedding) and an untied Llama."""
    from hf_testing.tiny import LLAMA, QWEN2_TIED, build_tiny_models

    specs = {"qwen2_tied": {**QWEN2_TIED, **TINY}, "llama": {**LLAMA, **TINY}}
    return build_tiny_models(tmp_path_factory.mktemp("models"), specs)
