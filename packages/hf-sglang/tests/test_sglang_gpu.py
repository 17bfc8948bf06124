"""The product path: SGLang on a CUDA GPU (skipped without one, and without SGLang's CUDA build).

Checks what the CPU harness cannot: the memory saver really frees device memory around
training (``release_memory`` / ``resume_memory``), weights survive a release/resume, and the
distributed transport works over nccl.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import needs_sglang

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_testing.prompts import encode, prompt_texts

pytestmark = [pytest.mark.gpu, needs_sglang]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[object]:
    from hf_sglang.engine import SGLangRolloutEngine

    eng = SGLangRolloutEngine(
        {"model_path": str(tiny_model), "device": "cuda", "mem_fraction_static": 0.3}
    )
    yield eng
    eng.close()


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_release_frees_device_memory_and_resume_restores(engine: object, tiny_model: Path) -> None:
    prompts = Batch(encode(tiny_model, prompt_texts(8)))
    before = engine.generate(prompts, GREEDY)["responses"]
    free = free_bytes()
    engine.release_memory()
    assert engine.memory_released
    assert free_bytes() > free + (64 << 20)  # the KV cache (and weights) left the device
    engine.resume_memory()
    assert not engine.memory_released
    assert torch.equal(engine.generate(prompts, GREEDY)["responses"], before)


def test_distributed_sync_over_nccl(engine: object, tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from hf_sglang.engine import make_transport

    prompts = Batch(encode(tiny_model, prompt_texts(8)))
    before = engine.generate(prompts, GREEDY)["responses"]
    state = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    tensors = [(k, v.cuda()) for k, v in state.items() if k != "lm_head.weight"]
    tensor_path = engine.transport
    engine.transport = make_transport(
        engine.engine, engine.config.model_copy(update={"weight_sync": "distributed"}), "cuda"
    )
    try:
        engine.load_weights(tensors[: len(tensors) // 2])
        engine.load_weights(tensors[len(tensors) // 2 :])
        engine.finish_weight_sync()
        assert engine.transport.backend == "nccl"
        assert torch.equal(engine.generate(prompts, GREEDY)["responses"], before)
    finally:
        engine.transport.close()
        engine.transport = tensor_path
