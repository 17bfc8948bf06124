"""The FSDP engine's ``auto`` micro-batch budget and gradient checkpointing.

Chosen once, at the first update, when everything the process holds besides the update's
own growth is resident (this engine's shards, a colocated rollout engine and reference
model, the runtime): the ranks of this group on the node then share the memory available,
and the estimate of :mod:`hf_core.engines.memory_fit` says how many tokens a micro-batch may
have and whether activations must be recomputed.  An update that cannot fit even one sample
raises :class:`~hf_core.errors.MemoryFitError` with the estimate instead of being killed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from hf_core.engines.memory_fit import (
    DEFAULT_MAX_TOKENS,
    MicroBatchFit,
    TrainingFootprint,
    device_growth_budget_bytes,
    fit_micro_batch,
)
from hf_core.errors import MemoryFitError
from hf_core.planner.models import from_hf_config
from hf_fsdp.config import FSDPEngineConfig
from hf_fsdp.loading import shards_per_layer

log = logging.getLogger(__name__)


def compute_dtype(cfg: FSDPEngineConfig, device: torch.device) -> torch.dtype:
    """The dtype activations are computed in (the mixed-precision policy's)."""
    return cfg.mixed_precision_dtype(device) or cfg.torch_param_dtype


def footprint(
    cfg: FSDPEngineConfig, hf_config: PretrainedConfig, model: nn.Module, world: int
) -> TrainingFootprint:
    spec = from_hf_config(hf_config.to_dict())
    if cfg.head != "lm":
        spec = spec.with_value_head()
    device = next(model.parameters()).device
    return TrainingFootprint(
        spec=spec,
        ranks=world,
        param_bytes=cfg.torch_param_dtype.itemsize,
        compute_bytes=compute_dtype(cfg, device).itemsize,
        trainable=cfg.trainable and cfg.lora is None,  # LoRA's trained state is tiny
        per_layer_units=shards_per_layer(model, cfg),
        logits_budget_bytes=cfg.logits_budget_bytes,
    )


def local_weight_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameter shards (already resident, so not growth)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def resolve_fit(
    cfg: FSDPEngineConfig,
    hf_config: PretrainedConfig,
    model: nn.Module,
    world: int,
    rank: int,
    longest_sample: int,
    growing_processes: int | None = None,
) -> MicroBatchFit:
    """The micro-batch tokens and checkpointing for this process (see the module docstring).
    ``world``: the processes the training state is split over; ``growing_processes``: those
    on this node whose memory grows during the update (default: all of the group's);
    ``longest_sample``: the tokens of the longest sample this process computes (its share
    under sequence parallelism)."""
    fixed_tokens = cfg.max_tokens_per_micro_batch
    checkpointing = cfg.gradient_checkpointing
    prints = footprint(cfg, hf_config, model, world)
    budget = device_growth_budget_bytes(
        next(model.parameters()).device, growing_processes=growing_processes
    )
    budget += local_weight_bytes(model)
    fit = fit_micro_batch(
        prints,
        budget,
        checkpointing=None if checkpointing == "auto" else checkpointing,
        min_tokens=longest_sample,
        max_tokens=fixed_tokens if isinstance(fixed_tokens, int) else DEFAULT_MAX_TOKENS,
    )
    if fit.total_bytes > fit.budget_bytes:
        raise MemoryFitError(
            f"rank {rank}: the update of {spec_name(prints)} cannot fit even one sample of "
            f"{longest_sample} tokens: {fit.describe()}. Use more processes (state is "
            "sharded over them), <role>.parallel.sp (each sequence's tokens split over "
            "ranks), bfloat16 parameters, LoRA, or shorter responses"
        )
    log.info(
        "rank %d: micro-batches of up to %d tokens, gradient checkpointing %s (%s)",
        rank,
        fit.max_tokens,
        "on" if fit.gradient_checkpointing else "off",
        fit.describe(),
    )
    return fit


RECORD_KEY = "micro_batch_fit"


def record(chosen: MicroBatchFit | None) -> dict[str, Any]:
    """What a checkpoint keeps of the choice (nothing when it was never made)."""
    if chosen is None:
        return {}
    return {
        RECORD_KEY: {
            "max_tokens": chosen.max_tokens,
            "gradient_checkpointing": chosen.gradient_checkpointing,
            "tokens_without_checkpointing": chosen.tokens_without_checkpointing,
        }
    }


def restored(manifest: dict[str, Any], current: MicroBatchFit | None) -> MicroBatchFit | None:
    """The choice a checkpoint recorded, so a resumed run splits batches into the same
    micro-batches (their summation order is part of the numbers); ``current`` otherwise."""
    saved = manifest.get(RECORD_KEY)
    if not saved:
        return current
    return MicroBatchFit(
        max_tokens=int(saved["max_tokens"]),
        gradient_checkpointing=bool(saved["gradient_checkpointing"]),
        parts={},
        budget_bytes=0,
        tokens_without_checkpointing=int(saved.get("tokens_without_checkpointing", 0)),
    )


def spec_name(prints: TrainingFootprint) -> str:
    return f"a {prints.spec.num_params / 1e6:.1f}M-parameter model"
