"""GPU tests skip without CUDA; ``models`` and ``ray_cluster`` come from hf-testing's plugin."""

from __future__ import annotations

import pytest

from hf_testing.gpu import skip_gpu_items

GPU_REASON = "needs a CUDA GPU (nccl, bf16 mixed precision, offload); this machine has none"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip_gpu_items(items, GPU_REASON)
