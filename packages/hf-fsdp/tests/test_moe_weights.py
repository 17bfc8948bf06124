"""Fused expert parameters <-> the checkpoint's per-expert tensors (hf_fsdp.fused_experts),
checked against transformers' own conversion, which is what ``save_pretrained`` writes and
what vLLM and SGLang load."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_core.engines.model_classes import checkpoint_names
from hf_core.errors import EngineConfigError
from hf_fsdp.fused_experts import expert_names, expert_slices, is_fused

TRUNK = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _tiny_moe(model_type: str) -> Any:
    """hf_testing's tiny Qwen3-MoE (4 experts, top-2), or a Mixtral of the same trunk."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from hf_testing.tiny import tiny_config

    config = tiny_config("qwen3_moe", 64, hidden_size=16, num_heads=2, num_kv_heads=1)
    if model_type == "mixtral":  # 3 experts as wide as its MLP
        trunk = {key: getattr(config, key) for key in TRUNK}
        config = MixtralConfig(**trunk, intermediate_size=8, num_local_experts=3)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_expert_slices_are_the_checkpoints_tensors(model_type: str) -> None:
    from transformers.core_model_loading import revert_weight_conversion

    model = _tiny_moe(model_type)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    saved = revert_weight_conversion(model, dict(state))  # what save_pretrained writes
    renamed = checkpoint_names(model, state)  # one-to-one renames (Mixtral's router)
    names = expert_names(model_type)
    ours: dict[str, torch.Tensor] = {}
    fused = 0
    for name, tensor in state.items():
        slices = expert_slices(name, tensor, names)
        if slices is None:
            assert not is_fused(name)
            ours[renamed[name]] = tensor
        else:
            fused += 1
            ours.update(slices)
    assert fused == 2 * 2  # gate_up and down in each of the two layers
    assert set(ours) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(ours[name], tensor), name


def test_slices_are_views_a_rollout_engine_copies_into() -> None:
    model = _tiny_moe("qwen3_moe")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    fused = dict(model.named_parameters())[name]
    slices = dict(expert_slices(name, fused.data, expert_names("qwen3_moe")) or [])
    half = fused.shape[1] // 2  # each expert's gate rows, then its up rows
    with torch.no_grad():
        slices["model.layers.1.mlp.experts.2.up_proj.weight"].fill_(7.0)
    assert bool((fused[2, half:] == 7.0).all()) and not bool((fused[2, :half] == 7.0).any())


def test_an_unmapped_moe_family_is_refused_by_name() -> None:
    with pytest.raises(EngineConfigError, match=r"'deepseek_v3'.*mapped: mixtral, qwen2_moe"):
        expert_names("deepseek_v3")
