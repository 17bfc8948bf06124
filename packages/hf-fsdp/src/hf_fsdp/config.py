"""Typed configuration of the FSDP training engine and the HF rollout engine.

Both are pydantic models with ``extra="forbid"``, so a misspelt key fails loudly instead of
being ignored.  :func:`parse_config` turns pydantic's report into one :class:`EngineConfigError`
whose lines name each bad key, the value given and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hf_core.config import EngineConfigError, parse_engine_config  # noqa: F401  (re-exported)
from hf_core.engines import DTypeName, HeadKind, to_dtype


class FSDPEngineConfig(BaseModel):
    """Everything one FSDP training engine (any role) needs.

    The same class serves every role: ``head`` picks the model kind, ``trainable=False`` makes a
    frozen model (reference policy, reward or cost model) with no optimiser state.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path = Field(description="local HuggingFace folder (config.json + safetensors)")
    head: HeadKind = "lm"
    trainable: bool = True
    tokenizer_path: Path | None = Field(
        None, description="tokenizer saved next to exported HF folders (default: none)"
    )

    # optimiser and schedule
    lr: float = Field(1e-6, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from lr/warmup_steps to lr")
    total_steps: int | None = Field(None, ge=1, description="needed by linear and cosine decay")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="decay floor, fraction of lr")
    grad_clip: float | None = Field(1.0, gt=0.0, description="max global grad norm; None: off")
    micro_batch_size: int = Field(8, ge=1, description="samples per forward/backward")

    # numerics and placement
    param_dtype: DTypeName = Field("float32", description="dtype of the sharded master weights")
    mixed_precision: Literal["auto", "none", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype; auto = bfloat16 on GPU, none on CPU (reduce in fp32)"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    reshard_after_forward: bool = True
    cpu_offload: bool = Field(
        False, description="FSDP2 CPUOffloadPolicy: shards live in host memory (GPU only)"
    )
    offload_params: bool = Field(True, description="offload() moves parameters to CPU")
    offload_optimizer: bool = Field(True, description="offload() moves optimiser state to CPU")
    gradient_checkpointing: bool = False
    disable_dropout: bool = Field(True, description="RL needs the same function in every pass")
    attn_implementation: str | None = Field(None, description="e.g. 'sdpa', 'eager'")
    export_dtype: DTypeName | None = Field(
        None, description="dtype of tensors streamed to rollout (default: param_dtype)"
    )
    seed: int = Field(0, description="seeds torch's RNG and new head weights (same on all ranks)")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {betas}")
        return betas

    @model_validator(mode="after")
    def _schedule_is_consistent(self) -> FSDPEngineConfig:
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs total_steps")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}"
            )
        return self

    @property
    def torch_param_dtype(self) -> torch.dtype:
        return to_dtype(self.param_dtype)


class HFRolloutConfig(BaseModel):
    """The HF-transformers rollout engine: a plain (unsharded) model per rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path
    dtype: DTypeName = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = Field(64, ge=1, description="sequences decoded together")
    attn_implementation: str | None = None
    seed: int = Field(0, description="sampling seed when SamplingParams.seed is None")


# Validation with errors naming key, value and expectation is core's (shared by backends).
parse_config = parse_engine_config
