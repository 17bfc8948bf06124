"""GPU-only checks (skipped without CUDA): sleep / wake around training, parity on CUDA.

These need vLLM's CUDA build (``pip install "hf-vllm[gpu]"``); the CPU build cannot sleep.
The engine runs in the test process (``uni`` executor), as a single-GPU hybrid worker would.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_testing.prompts import prompt_batch

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def engine(models: dict[str, Path]) -> Iterator[object]:
    pytest.importorskip("vllm", reason="vLLM's CUDA build is not installed")
    from hf_vllm.engine import VLLMRolloutEngine

    yield VLLMRolloutEngine(
        {"model_path": str(models["qwen2_tied"]), "gpu_memory_utilization": 0.3}
    )


@pytest.fixture(scope="module")
def prompts(models: dict[str, Path]) -> Batch:
    return prompt_batch(models["qwen2_tied"], 32)


def _free_gpu_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_greedy_on_cuda_matches_hf_generate(engine, prompts: Batch, models: dict) -> None:
    from test_vllm_hybrid import hf_generate

    out = engine.generate(prompts, GREEDY)
    expected = hf_generate(models["qwen2_tied"], prompts, 12)
    mask = out["response_mask"][:, : expected.shape[1]].bool()
    # bf16-free float32 on both sides: greedy ids agree except where two logits nearly tie.
    agree = (out["responses"][:, : expected.shape[1]] == expected)[mask].float().mean()
    assert agree > 0.95


def test_release_frees_device_memory_and_resume_restores(engine, prompts: Batch) -> None:
    before = engine.generate(prompts, GREEDY)
    free_awake = _free_gpu_bytes()
    engine.release_memory()
    assert engine.memory_released
    free_asleep = _free_gpu_bytes()
    assert free_asleep - free_awake > 256 * 2**20  # at least the KV cache went back
    engine.resume_memory()
    assert not engine.memory_released
    assert _free_gpu_bytes() < free_asleep - 256 * 2**20
    again = engine.generate(prompts, GREEDY)
    assert torch.equal(before["responses"], again["responses"])  # level 1 kept the weights


def test_sync_while_asleep_wakes_weights_first(engine, prompts: Batch, models: dict) -> None:
    from transformers import AutoModelForCausalLM

    from hf_core.engines import iter_buckets

    reference = engine.generate(prompts, GREEDY)
    model = AutoModelForCausalLM.from_pretrained(models["qwen2_tied"])
    stream = [(n, p.detach().cuda()) for n, p in model.named_parameters()]
    engine.release_memory()
    for bucket in iter_buckets(((n, t * 1.5) for n, t in stream), 1 << 16):
        engine.load_weights(bucket)
    engine.finish_weight_sync()
    changed = engine.generate(prompts, GREEDY)  # generate wakes the KV cache itself
    engine.release_memory()
    for bucket in iter_buckets(iter(stream), 1 << 16):
        engine.load_weights(bucket)
    engine.finish_weight_sync()
    restored = engine.generate(prompts, GREEDY)
    assert not torch.equal(changed["responses"], reference["responses"])
    assert torch.equal(restored["responses"], reference["responses"])
    assert engine.last_sync_seconds is not None and engine.last_sync_seconds > 0
