"""Mixture-of-experts models on SGLang (docs/moe.md): the weights a sync sends are the
checkpoint's per-expert tensors (transformers 5 fuses them in its own model; SGLang loads the
checkpoint's names), and the settings say routing replay is not available.  That SGLang's CPU
path runs the tiny Qwen3-MoE and keeps greedy decoding equal to transformers' across in-place
syncs is the conformance kit's MoE case (test_conformance.py, mixture_of_experts = "runs")."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_core.engines.capabilities import DeclaresRoutedExperts
from hf_sglang.config import SGLangRolloutConfig
from hf_sglang.weights import canonical_shapes
from hf_testing.conformance import folder_tensors


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def test_sync_names_are_the_checkpoints_per_expert_tensors(moe_path: Path) -> None:
    shapes = canonical_shapes(moe_path)
    saved = {name: tuple(t.shape) for name, t in folder_tensors(moe_path).items()}
    assert shapes == saved
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in shapes
    assert not any(name.endswith("experts.gate_up_proj") for name in shapes)


def test_settings_say_routing_replay_is_unavailable(moe_path: Path) -> None:
    settings = SGLangRolloutConfig(model_path=moe_path)
    assert isinstance(settings, DeclaresRoutedExperts)
    assert "does not return the experts it routes to" in (
        settings.routed_experts_unsupported() or ""
    )
