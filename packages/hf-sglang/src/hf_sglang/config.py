"""Typed configuration of the SGLang rollout engine.

A pydantic model with ``extra="forbid"``, validated by core's ``parse_engine_config``: a
misspelt key fails loudly with core's ``EngineConfigError`` naming the key.  Anything
``sglang.Engine`` accepts that is not modelled here goes through ``engine_kwargs`` untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hf_core.config import EngineConfigError, parse_engine_config
from hf_core.engines import DTypeName

WeightSyncMode = Literal["tensor", "distributed"]


class SyncGroupConfig(BaseModel):
    """The process group of ``weight_sync: distributed`` (trainer rank 0 + the engine's ranks)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    master_address: str = Field("127.0.0.1", description="address the trainer side listens on")
    master_port: int = Field(0, ge=0, le=65535, description="0: pick a free port")
    group_name: str = "hybridflow_weight_sync"
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto: nccl on GPU, gloo on CPU"
    )
    timeout_s: float = Field(600.0, gt=0.0)


class SGLangRolloutConfig(BaseModel):
    """Everything one SGLang rollout engine (one per actor rank, hybrid mode) needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path = Field(description="local HuggingFace folder (config.json + weights)")
    dtype: DTypeName = Field(
        "float32", description="compute dtype; float32 keeps log-probs comparable to training"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks of one engine")
    attention_backend: str | None = Field(
        None, description="None: torch_native on CPU, SGLang's choice on GPU"
    )
    mem_fraction_static: float | None = Field(
        None, gt=0.0, lt=1.0, description="share of device memory for weights + KV cache"
    )
    max_total_tokens: int | None = Field(
        None, ge=1, description="KV-cache size in tokens (CPU default: 16384)"
    )
    max_running_requests: int | None = Field(None, ge=1)
    context_length: int | None = Field(None, ge=1)
    weight_sync: WeightSyncMode = Field(
        "tensor",
        description="tensor: update_weights_from_tensor (same host); distributed: broadcast "
        "over a process group (init_weights_update_group + update_weights_from_distributed)",
    )
    sync_group: SyncGroupConfig = Field(default_factory=SyncGroupConfig)
    enable_memory_saver: bool = Field(
        True, description="GPU: lets release_memory free weights and KV cache while training"
    )
    ignore_eos: bool = Field(False, description="decode to max_new_tokens (benchmarks)")
    seed: int = Field(0, description="the scheduler's sampling RNG seed")
    log_level: str = "error"
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="passed to sglang.Engine as is (overrides the above)"
    )

    def routed_experts_unsupported(self) -> str | None:
        """``DeclaresRoutedExperts``: SGLang runs mixture-of-experts models (docs/moe.md) but
        hf-sglang does not return the experts it routes to, so routing replay is refused
        before a run starts."""
        return (
            "the SGLang rollout engine does not return the experts it routes to (sglang 0.5.23 "
            "has no per-token routing output hf-sglang reads)"
        )


def parse_config(data: dict[str, Any] | SGLangRolloutConfig) -> SGLangRolloutConfig:
    """Validate engine settings; problems raise core's :class:`EngineConfigError` naming the key."""
    return parse_engine_config(SGLangRolloutConfig, data)


__all__ = ["EngineConfigError", "SGLangRolloutConfig", "SyncGroupConfig", "parse_config"]
