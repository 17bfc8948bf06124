"""The lean Llama-family decoder against transformers' forward on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_fsdp.decoder import (
    LlamaFamilyDecoder,
    LlamaFamilySession,
    TransformersSession,
    lean_decoder_unsupported,
)
from hf_fsdp.rollout import TransformersRolloutEngine
from hf_testing.tiny import build_tiny_model


def left_padded_prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (4, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # shorter prompts, left-padded
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("name", ["qwen2_tied", "llama"])  # q/k/v biases and tied head; neither
def test_lean_logits_equal_transformers_at_prefill_and_every_step(models: dict, name: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(models[name]).eval().requires_grad_(False)
    assert lean_decoder_unsupported(model) is None
    ids, mask = left_padded_prompts(model.config.vocab_size)
    steps = 6
    lean = LlamaFamilyDecoder(model).open(ids, mask, steps)
    reference = TransformersSession(model, ids, mask, steps)
    assert isinstance(lean, LlamaFamilySession)
    with torch.no_grad():
        torch.testing.assert_close(lean.prefill(), reference.prefill(), rtol=1e-5, atol=1e-5)
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            tokens = torch.randint(3, model.config.vocab_size, (4,), generator=gen)
            torch.testing.assert_close(
                lean.step(tokens), reference.step(tokens), rtol=1e-5, atol=1e-5
            )


def test_a_group_of_samples_is_prefilled_once(models: dict) -> None:
    """Rows that repeat a prompt ``n`` times (GRPO's samples) are prefilled on one row per
    group, and decode as if every row had been prefilled: the same logits at the prefill and
    at every step after it, against the same session without grouping."""
    model = AutoModelForCausalLM.from_pretrained(models["qwen2_tied"]).eval().requires_grad_(False)
    ids, mask = left_padded_prompts(model.config.vocab_size)
    n, steps = 3, 5
    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    decoder = LlamaFamilyDecoder(model)
    prefilled_rows = []
    forward = decoder.forward

    def counting_forward(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        prefilled_rows.append(input_ids.shape[0])
        return forward(input_ids, *args)  # type: ignore[arg-type]

    decoder.forward = counting_forward  # type: ignore[method-assign]
    grouped = decoder.open(ids, mask, steps, group=n)
    plain = decoder.open(ids, mask, steps)
    with torch.no_grad():
        torch.testing.assert_close(grouped.prefill(), plain.prefill(), rtol=1e-5, atol=1e-5)
        assert prefilled_rows == [len(ids) // n, len(ids)]
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):  # the rows of a group now diverge, as sampled tokens do
            tokens = torch.randint(3, model.config.vocab_size, (len(ids),), generator=gen)
            torch.testing.assert_close(
                grouped.step(tokens), plain.step(tokens), rtol=1e-5, atol=1e-5
            )
    # rows that do not repeat are never grouped, whatever the caller says
    assert decoder.open(ids[:-1], mask[:-1], steps, group=n).group == 1
    shuffled = torch.roll(ids, 1, dims=0)
    assert decoder.open(shuffled, mask, steps, group=n).group == 1


def test_weight_sync_in_place_reaches_the_fused_projections(models: dict, tmp_path: Path) -> None:
    """q/k/v and gate/up run as one GEMM each over views of the HF parameters: weights
    copied into those parameters must change what the lean decoder computes."""
    other = build_tiny_model(tmp_path / "other", "qwen2", tie_word_embeddings=True, seed=7)
    new_weights = dict(AutoModelForCausalLM.from_pretrained(other).state_dict())
    ids, mask = left_padded_prompts(128)
    prompts = Batch({"input_ids": ids, "attention_mask": mask})
    params = SamplingParams(temperature=0, max_new_tokens=6)
    outputs = {}
    for decoder in ("auto", "transformers"):
        engine = TransformersRolloutEngine(
            {"model_path": str(models["qwen2_tied"]), "decoder": decoder}
        )
        assert (engine._lean is not None) == (decoder == "auto")
        before = engine.generate(prompts, params)
        engine.load_weights(
            (name, tensor) for name, tensor in new_weights.items() if name != "lm_head.weight"
        )
        engine.finish_weight_sync()
        outputs[decoder] = (before, engine.generate(prompts, params))
    lean_before, lean_after = outputs["auto"]
    assert not torch.equal(lean_before["responses"], lean_after["responses"])
    reference = outputs["transformers"][1]
    assert torch.equal(lean_after["responses"], reference["responses"])
    torch.testing.assert_close(
        lean_after["rollout_log_probs"], reference["rollout_log_probs"], rtol=0, atol=1e-5
    )


def test_an_unsupported_model_decodes_with_transformers(models: dict) -> None:
    model = AutoModelForCausalLM.from_pretrained(models["llama"])
    model.config.hidden_act = "gelu"
    assert "hidden_act" in (lean_decoder_unsupported(model) or "")
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaFamilyDecoder(model)
