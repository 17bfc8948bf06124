"""The settings every training engine shares, with one meaning whichever backend trains.

A backend's engine config subclasses :class:`TrainingEngineConfig` and adds its own keys
(parallel sizes, FSDP's sharding switches, ...), so a recipe switches backend by changing
the engine name and adding those keys; the optimiser, schedule and placement keys stay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hf_core.engines.dtypes import DTypeName, HeadKind
from hf_core.engines.schedule import Schedule, lr_factor


class TrainingEngineConfig(BaseModel):
    """Model, optimiser, schedule and placement keys of a training engine (any role).

    ``head`` picks the model kind; ``trainable=False`` makes a frozen model (reference policy,
    reward or cost model) with no optimiser state.
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
    lr_schedule: Schedule = "constant"
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from lr/warmup_steps to lr")
    total_steps: int | None = Field(None, ge=1, description="needed by linear and cosine decay")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="decay floor, fraction of lr")
    grad_clip: float | None = Field(1.0, gt=0.0, description="max global grad norm; None: off")

    # placement and export
    device: Literal["auto", "cpu", "cuda"] = "auto"
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
    def _schedule_is_consistent(self) -> TrainingEngineConfig:
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs total_steps")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}"
            )
        return self

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` for the optimiser step after ``step`` completed steps."""
        return lr_factor(
            step,
            warmup_steps=self.warmup_steps,
            schedule=self.lr_schedule,
            total_steps=self.total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )
