"""A batch whose prompts outgrow one scheduler step: vLLM on CPU must prefill each prompt whole.

vLLM rewinds a request's seeded sampling generator after a partial (chunked) prefill, which a
CPU generator cannot do ("CPU Generator does not use offset"); every request of this engine is
seeded, so the engine turns chunked prefill off on CPU (``whole_prefill_kwargs``).  The engine
runs in a child interpreter: a ``vllm.LLM`` built in the test process would stay there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_engine_child

CHILD = """
import json, sys, torch
from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_vllm.engine import VLLMRolloutEngine

engine = VLLMRolloutEngine({
    "model_path": sys.argv[1], "kv_cache_bytes": 64 * 2**20,
    "max_model_len": 64, "max_num_batched_tokens": 64, "max_num_seqs": 32,
})
vocab = json.loads(open(sys.argv[1] + "/config.json").read())["vocab_size"]
ids = torch.randint(3, vocab, (16, 20), generator=torch.Generator().manual_seed(0))
prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=7)
first, second = (engine.generate(prompts, params)["responses"] for _ in range(2))
same = bool(torch.equal(first, second))
print("RESULT " + json.dumps({"shape": list(first.shape), "same": same}))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (GPU builds chunk prefills)")
def test_prompts_beyond_one_step_token_budget_generate_reproducibly(
    models: dict[str, Path],
) -> None:
    # 32 sequences x 20 prompt tokens = 640 tokens against a budget of 64 per step: with
    # chunked prefill on, several prompts would be split and vLLM would fail.
    result = run_engine_child(CHILD, str(models["qwen2_tied"]))
    assert result == {"shape": [32, 6], "same": True}


def test_cpu_kwargs_prefill_whole_prompts_within_a_budget_that_holds_the_longest(
    models: dict[str, Path],
) -> None:
    from hf_vllm.config import VLLMRolloutConfig
    from hf_vllm.engine import CPU_TOKEN_BUDGET, llm_kwargs
    from hf_vllm.model_info import max_positions

    path = models["llama"]
    longest = max_positions(path)
    assert longest is not None and longest > 0
    cpu = llm_kwargs(VLLMRolloutConfig(model_path=path), path, "uni", on_gpu=False)
    assert cpu["enable_chunked_prefill"] is False
    assert cpu["max_num_batched_tokens"] == max(CPU_TOKEN_BUDGET, longest)
    short = VLLMRolloutConfig(model_path=path, max_model_len=64, max_num_batched_tokens=64)
    assert llm_kwargs(short, path, "uni", on_gpu=False)["max_num_batched_tokens"] == 64
    chunked = VLLMRolloutConfig(model_path=path, engine_kwargs={"enable_chunked_prefill": True})
    assert llm_kwargs(chunked, path, "uni", on_gpu=False)["enable_chunked_prefill"] is True
    gpu = llm_kwargs(VLLMRolloutConfig(model_path=path), path, "uni", on_gpu=True)
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu


def test_cpu_engines_get_a_fixed_kv_cache_and_declare_their_overhead(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left to itself vLLM's CPU worker grows to ``gpu_memory_utilization`` of the node per
    engine (two hybrid ranks would ask for the whole node); the CPU default is a fixed KV
    cache, and the pre-start memory check counts it and vLLM's runtime."""
    from hf_core.engines import DeclaresHostOverhead
    from hf_vllm.config import CPU_DEFAULT_KV_CACHE_BYTES, CPU_RUNTIME_BYTES, VLLMRolloutConfig
    from hf_vllm.engine import llm_kwargs

    path = models["llama"]
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    plain = VLLMRolloutConfig(model_path=path)
    shape = json.loads((path / "config.json").read_text())
    head = shape["vocab_size"] * shape["hidden_size"] * 4  # float32, one rank
    assert plain.packed_head_bytes() == head
    engine_bytes = CPU_RUNTIME_BYTES + head
    assert isinstance(plain, DeclaresHostOverhead)
    assert llm_kwargs(plain, path, "uni", on_gpu=False)["kv_cache_memory_bytes"] == (
        CPU_DEFAULT_KV_CACHE_BYTES
    )
    assert plain.host_overhead_bytes() == CPU_DEFAULT_KV_CACHE_BYTES + engine_bytes
    assert "kv_cache_memory_bytes" not in llm_kwargs(plain, path, "uni", on_gpu=True)
    explicit = VLLMRolloutConfig(model_path=path, kv_cache_bytes=2**28)
    assert llm_kwargs(explicit, path, "uni", on_gpu=False)["kv_cache_memory_bytes"] == 2**28
    assert explicit.host_overhead_bytes() == 2**28 + engine_bytes
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # vLLM lets it win on the CPU
    assert plain.host_overhead_bytes() == explicit.host_overhead_bytes()
    assert explicit.host_overhead_bytes() == 3 * 2**30 + engine_bytes
