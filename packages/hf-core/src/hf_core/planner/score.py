"""``d_cost`` of Algorithm 1: the iteration time of a placement from per-model stage times.

Stages run one after another; inside a stage, colocated models share devices and run in
sequence (their times add up) while separate sets run concurrently (the slowest set decides).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def pool_stage_seconds(
    roles: Iterable[str], model_seconds: Mapping[str, Mapping[str, float]], stages: Sequence[str]
) -> dict[str, float]:
    """Per stage, the sum of the pool's models' seconds (they take turns on the devices)."""
    roles = list(roles)
    return {s: sum(model_seconds.get(r, {}).get(s, 0.0) for r in roles) for s in stages}


def combine(
    pools: Iterable[Mapping[str, float]], stages: Sequence[str]
) -> tuple[dict[str, float], float]:
    """Per stage, the max over pools; the iteration is the sum over stages."""
    pools = list(pools)
    per_stage = {s: max((p.get(s, 0.0) for p in pools), default=0.0) for s in stages}
    return per_stage, sum(per_stage.values())


def aggregate(
    placement: Sequence[Sequence[str]],
    model_seconds: Mapping[str, Mapping[str, float]],
    stages: Sequence[str],
) -> tuple[dict[str, float], float]:
    """The paper's score: sum inside each colocated set, max across sets, sum over stages."""
    return combine((pool_stage_seconds(s, model_seconds, stages) for s in placement), stages)
