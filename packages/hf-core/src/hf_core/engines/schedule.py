"""Learning-rate schedule shared by training engines: linear warm-up, then constant or decay."""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]


def lr_factor(
    step: int,
    *,
    warmup_steps: int = 0,
    schedule: Schedule = "constant",
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiplier of the base learning rate for the optimiser step after ``step`` steps.

    Warm-up is linear and reaches the full rate on step ``warmup_steps - 1`` (it never spends
    a step at lr 0); decay then runs from the full rate to ``min_lr_ratio`` at ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps is None:
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
