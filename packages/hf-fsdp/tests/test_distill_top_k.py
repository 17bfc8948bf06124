"""Top-k distillation through one FSDP engine: the update's gradients equal plain autograd
through transformers however the micro-batch is laid out (padded rows, shared prompts packed,
samples packed back to back, the chunked head).  Two ranks with sequence parallelism:
``test_fsdp_dp2.py::test_sequence_parallel_pair_equals_one_rank[lm-top-k]``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_core.batch import Batch
from hf_core.engines.top_k import LOG_PROBS_AT_TEACHER_TOP_K, TEACHER_TOP_K_IDS
from hf_fsdp.engine import FSDPEngine
from hf_testing.workers import distill_top_k_loss, rollout_batch, with_teacher_top_k

VOCAB = 128
ATOL = 1e-5
CHUNKED = {"logits_budget_bytes": 3 * 4 * VOCAB}  # 3 tokens' logits a chunk, a remainder
LAYOUTS: dict[str, dict[str, Any]] = {
    "padded-rows": {"shared_prefix": False, "sequence_packing": False},
    "shared-prompts-packed": {"shared_prefix": True, "sequence_packing": False},
    "sequence-packed": {"shared_prefix": False, "sequence_packing": True},
    "chunked-head": {"shared_prefix": False, "sequence_packing": False, **CHUNKED},
    "packed-chunked-head": {"shared_prefix": True, "sequence_packing": True, **CHUNKED},
}


def _batch() -> Batch:
    """Groups of 4 samples sharing a prompt (what shared-prompt packing packs), uneven
    lengths (the masks), and a teacher's top-5 per response position."""
    batch = rollout_batch(8, 6, 7, VOCAB, seed=3, group_size=4)
    return with_teacher_top_k(batch, VOCAB, k=5, seed=4)


def _reference(path: Path, batch: Batch) -> tuple[dict[str, torch.Tensor], float]:
    """The loss's gradients through transformers on the whole batch, and the loss."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits
    width = batch["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1)
    outputs = {
        "log_probs": log_probs.gather(-1, batch["responses"][..., None])[..., 0],
        "entropy": -(log_probs.exp() * log_probs).sum(-1),
        LOG_PROBS_AT_TEACHER_TOP_K: log_probs.gather(-1, batch[TEACHER_TOP_K_IDS].long()),
    }
    batch.meta.update(dp_size=1, global_response_tokens=float(batch["response_mask"].sum()))
    loss, _ = distill_top_k_loss(outputs, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, float(loss.detach())


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_top_k_distillation_step_equals_transformers_autograd(
    models: dict, layout: dict[str, Any]
) -> None:
    path = models["qwen2_tied"]
    batch = _batch()
    expected, expected_loss = _reference(path, _batch())
    engine = FSDPEngine(
        {"model_path": str(path), "lr": 1e-3, "micro_batch_size": 4, "grad_clip": 1e9, **layout}
    )
    grads: dict[str, torch.Tensor] = {}
    assert engine.optimizer is not None

    def capture(*_args: object) -> None:
        grads.update({n: p.grad.clone() for n, p in engine.model.named_parameters()})

    engine.optimizer.register_step_pre_hook(capture)
    metrics = engine.train_step(batch, distill_top_k_loss)
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)
    if layout.get("shared_prefix") or layout.get("sequence_packing"):  # it did pack
        assert metrics["forward_token_fraction"] < 1.0
    assert grads.keys() >= expected.keys()
    worst = {n: float((grads[n] - expected[n]).abs().max()) for n in expected}
    assert max(worst.values()) < ATOL, worst
