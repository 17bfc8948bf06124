"""LoRA adapters: the recipe's settings, canonical adapter names and the peft folder format.

A training engine that trains LoRA adapters streams them under *canonical adapter names*: the
HF name of the adapted module plus ``lora_A.weight`` / ``lora_B.weight`` (e.g.
``model.layers.0.self_attn.q_proj.lora_A.weight``).  A rollout engine that serves adapters
(:class:`~hf_core.engines.ServesAdapters`) loads them as they are; one that does not gets the
merged weights ``W + (alpha / rank) * B @ A`` under the usual canonical names.  On disk an
adapter is a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``), which
``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` both load.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hf_core.engines.weights import NamedTensor

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""peft's saved names put this before the model's own module path."""

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(BaseModel):
    """LoRA adapters on a training engine (``<role>.engine.lora`` in a recipe).

    Only the adapters (and a value/score head) train and have optimiser state; the base
    weights stay frozen, so the actor with its adapters disabled *is* the base model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(8, ge=1, description="LoRA rank r")
    alpha: float = Field(16.0, gt=0.0, description="scaling numerator: updates are alpha / r")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter input")
    target_modules: tuple[str, ...] = Field(
        DEFAULT_TARGETS,
        min_length=1,
        description="names (last path component) of the linear layers that get adapters",
    )

    @field_validator("target_modules")
    @classmethod
    def _no_empty_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if any(not name.strip() for name in names):
            raise ValueError(f"target module names must be non-empty, got {list(names)}")
        return names

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def is_adapter_name(name: str) -> bool:
    """Whether a canonical name is a LoRA adapter tensor (not a base weight)."""
    return name.endswith(ADAPTER_SUFFIXES)


def adapted_module(name: str) -> str:
    """``m.lora_A.weight`` -> ``m``: the module an adapter tensor belongs to."""
    for suffix in ADAPTER_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    raise ValueError(f"{name!r} is not a LoRA adapter tensor name")


def peft_config_dict(config: LoRAConfig, base_model: str | Path | None) -> dict[str, object]:
    """``adapter_config.json`` as peft writes it for these settings (the keys peft and vLLM
    read; everything else takes peft's defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model) if base_model is not None else None,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(config.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_folder(
    path: str | Path,
    config: LoRAConfig,
    tensors: Iterable[NamedTensor],
    base_model: str | Path | None = None,
) -> Path:
    """Write adapters (canonical adapter names) as a peft folder, atomically: it is filled
    next to ``path`` and renamed into place, so a reader never sees half an adapter."""
    from safetensors.torch import save_file

    path = Path(path)
    state = {PEFT_PREFIX + name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors}
    bad = [name for name in state if not is_adapter_name(name)]
    if bad:
        raise ValueError(f"not LoRA adapter tensors: {bad[:3]}")
    if not state:
        raise ValueError("no adapter tensors to write (is LoRA enabled on this engine?)")
    tmp = path.parent / f".{path.name}.tmp-adapter"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / ADAPTER_WEIGHTS), {"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config_dict(config, base_model), indent=2))
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def merge_adapter(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``W + scaling * B @ A``, computed in float32 and returned in ``W``'s dtype."""
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)
