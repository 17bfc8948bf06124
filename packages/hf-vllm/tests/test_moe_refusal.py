"""A mixture-of-experts model on vLLM's CPU path is refused by name before vLLM starts: vLLM
on a CPU does not reload an MoE layer in place (a reload of unchanged expert weights changes
the greedy output), so every weight sync would corrupt the model.  Routing replay is refused
for vLLM before a run starts, whatever the device (its settings say why)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_core.errors import EngineConfigError
from hf_testing.tiny import tiny_config
from hf_vllm.config import VLLMRolloutConfig
from hf_vllm.engine import refuse_cpu_mixture_of_experts


def _folder(tmp_path: Path, family: str) -> Path:
    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_config(family, 128).to_dict()))  # type: ignore[arg-type]
    return folder


def test_a_mixture_of_experts_is_refused_on_cpu_and_a_dense_model_is_not(tmp_path: Path) -> None:
    refuse_cpu_mixture_of_experts(_folder(tmp_path, "qwen2"))
    with pytest.raises(EngineConfigError, match="does not reload a mixture-of-experts layer"):
        refuse_cpu_mixture_of_experts(_folder(tmp_path, "qwen3_moe"))


def test_vllm_settings_say_they_return_no_routed_experts(tmp_path: Path) -> None:
    settings = VLLMRolloutConfig(model_path=tmp_path)
    assert "V2 model runner" in (settings.routed_experts_unsupported() or "")
