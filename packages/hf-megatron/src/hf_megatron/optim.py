"""The learning-rate schedule, with hf-fsdp's meaning of the shared config keys.

megatron's own ``OptimizerParamScheduler`` counts steps differently; the engine sets each
param group's ``lr`` from :func:`lr_factor` before every step instead, so a recipe gets the
same schedule whichever backend trains it.
"""

from __future__ import annotations

import math

from hf_megatron.config import MegatronEngineConfig


def lr_factor(step: int, cfg: MegatronEngineConfig) -> float:
    """Multiplier of ``cfg.lr`` for the optimiser step after ``step`` completed steps.

    Warm-up is linear and reaches the full rate on step ``warmup_steps - 1`` (it never spends
    a step at lr 0); decay then runs from the full rate to ``min_lr_ratio`` at ``total_steps``.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant" or cfg.total_steps is None:
        return 1.0
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
