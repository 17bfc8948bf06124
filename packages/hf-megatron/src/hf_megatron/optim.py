"""The learning-rate schedule, with hf-fsdp's meaning of the shared config keys.

megatron's own ``OptimizerParamScheduler`` counts steps differently; the engine sets each
param group's ``lr`` from :func:`lr_factor` before every step instead, so a recipe gets the
same schedule whichever backend trains it (core's :func:`hf_core.engines.lr_factor`).
"""

from __future__ import annotations

from hf_megatron.config import MegatronEngineConfig


def lr_factor(step: int, cfg: MegatronEngineConfig) -> float:
    """Multiplier of ``cfg.lr`` for the optimiser step after ``step`` completed steps."""
    return cfg.lr_factor(step)
