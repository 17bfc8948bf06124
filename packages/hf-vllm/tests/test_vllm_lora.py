"""A LoRA-trained FSDP actor synced into vLLM (one rank, in the test process): adapters only
when vLLM serves LoRA (``max_lora_rank``), merged weights when it does not; either way the
rollout log-probs are the training engine's after an update and a sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf_core.batch import Batch
from hf_core.engines import SamplingParams, ServesAdapters
from hf_core.sync import AdapterSync
from hf_fsdp.engine import FSDPEngine
from hf_testing.prompts import prompt_batch
from hf_vllm.engine import VLLMRolloutEngine

MODEL = "qwen2_tied"
LOGPROB_ATOL = 1e-4  # see test_vllm_hybrid: kernel rounding is ~2e-5 at worst
LORA = {"rank": 8, "alpha": 16.0}
SAMPLE = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)


def _advantaged(batch: Batch, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=gen)
    return batch


def _pg_loss(outputs: dict, mb: Batch) -> tuple[torch.Tensor, dict]:
    mask = mb["response_mask"].float()
    scale = mb.meta["dp_size"] / mb.meta["global_response_tokens"]
    return (-outputs["log_probs"] * mb["advantages"] * mask).sum() * scale, {}


@pytest.fixture(scope="module")
def actor(models: dict[str, Path]) -> FSDPEngine:
    return FSDPEngine(
        {"model_path": str(models[MODEL]), "lr": 5e-2, "micro_batch_size": 8, "lora": LORA}
    )


@pytest.fixture(scope="module")
def prompts(models: dict[str, Path]) -> Batch:
    return prompt_batch(models[MODEL], 16)


@pytest.fixture
def vllm_engine(models: dict[str, Path], request: pytest.FixtureRequest) -> Iterator:
    engine = VLLMRolloutEngine({"model_path": str(models[MODEL]), **request.param})
    yield engine
    engine.close()


def _max_diff(out: Batch, log_probs: torch.Tensor) -> float:
    return float(((out["rollout_log_probs"] - log_probs) * out["response_mask"]).abs().max())


@pytest.mark.parametrize(
    ("vllm_engine", "adapters_only"),
    [({"max_lora_rank": 8}, True), ({}, False)],
    indirect=["vllm_engine"],
    ids=["adapters", "merged"],
)
def test_update_then_sync_matches_training_log_probs(
    actor: FSDPEngine, vllm_engine: VLLMRolloutEngine, prompts: Batch, adapters_only: bool
) -> None:
    assert isinstance(vllm_engine, ServesAdapters)
    assert vllm_engine.serves_adapters(actor.config.lora) is adapters_only  # type: ignore[arg-type]
    sync = AdapterSync(actor, vllm_engine, actor.config.lora, bucket_bytes=1 << 20)  # type: ignore[arg-type]
    before = vllm_engine.generate(prompts, SAMPLE)
    actor.train_step(_advantaged(before, seed=1), _pg_loss)  # B moves off zero
    metrics = sync.run()

    out = vllm_engine.generate(prompts, SAMPLE)
    trained = actor.compute_log_probs(out)["log_probs"]
    with actor.adapters_disabled():
        base = actor.compute_log_probs(out)["log_probs"]
    assert _max_diff(out, trained) <= LOGPROB_ATOL
    assert _max_diff(out, base) > 1e-3  # the update reached vLLM

    adapter_bytes = sum(t.numel() * 4 for b in actor.export_adapters(1 << 20) for _, t in b)
    assert metrics["lora/adapters_only"] == float(adapters_only)
    if adapters_only:
        assert metrics["lora/sync_bytes"] == adapter_bytes
        assert metrics["weight_sync/bytes"] == adapter_bytes
    else:
        assert metrics["lora/sync_bytes"] > 5 * adapter_bytes  # the whole (merged) model
