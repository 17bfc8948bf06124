"""The reshard plan of one training engine / rollout engine pair (HybridFlow §5.4).

A model-parallel training engine (:class:`~hf_core.engines.ReshardsWeights`, e.g. megatron's
TP x PP) hands its weights over by core's plan, built from its training layout ``(p, t, d)``
and the rollout engine's generation layout ``(p_g, t_g)``; a data-parallel engine (FSDP)
needs none.  Built and checked once, when the actor's sync is chosen.
"""

from __future__ import annotations

from typing import Literal

from hf_core.engines import (
    HasGenerationRank,
    LoadsTPSlices,
    ReshardsWeights,
    RolloutEngine,
    TrainingEngine,
)
from hf_core.resharding import GenerationLayout, ReshardPlan, build_hybrid_plan, build_naive_plan

ReshardKind = Literal["hybrid", "naive"]

WHOLE_MODEL = GenerationLayout(pp=1, tp=1)


def generation_layout(rollout: RolloutEngine) -> GenerationLayout:
    """``(p_g, t_g)`` of a rollout engine that loads TP slices; a whole-tensor engine needs
    the whole model on every rank (``p_g = t_g = 1``)."""
    return rollout.generation_layout() if isinstance(rollout, LoadsTPSlices) else WHOLE_MODEL


def build_plan(
    actor: TrainingEngine,
    rollout: RolloutEngine,
    kind: ReshardKind,
    resolved: GenerationLayout | None = None,
) -> ReshardPlan | None:
    """Core's reshard plan for this pair, or ``None`` when the actor is data parallel.

    ``resolved`` is the run's generation layout (:func:`hf_core.config.layout.resolve_layout`),
    which the rollout engine was built with; what the engine reports must agree with it.
    ``None`` (engines driven without a recipe, in tests and benches): the engine's report."""
    gen = generation_layout(rollout)
    if resolved is not None and gen != resolved:
        raise RuntimeError(
            f"{type(rollout).__name__} formed the generation layout {gen}, but the run's "
            f"resolved layout is {resolved}"
        )
    if not isinstance(actor, ReshardsWeights):
        return None
    build = build_hybrid_plan if kind == "hybrid" else build_naive_plan
    train = actor.parallel_layout()
    try:
        return build(train, gen)
    except ValueError as exc:
        raise ValueError(
            f"{type(rollout).__name__}'s generation layout (p_g={gen.pp}, t_g={gen.tp}) cannot "
            f"be resharded from {type(actor).__name__}'s training layout (p={train.pp}, "
            f"t={train.tp}, d={train.dp}): t_g must divide t and p_g must divide p ({exc})"
        ) from None


def check_generation_rank(plan: ReshardPlan, rank: int, rollout: RolloutEngine) -> None:
    """The rollout engine's TP group must be the one the plan hands this rank's slices to."""
    if not isinstance(rollout, HasGenerationRank):
        return
    built = rollout.generation_rank()
    planned = plan.for_rank(rank)
    first = rank - built.tp_rank
    group = tuple(range(first, first + built.tp_size))
    if built.tp_size != plan.gen.tp or planned.gen_tp_group != group:
        raise RuntimeError(
            f"rank {rank}: the rollout engine's TP group {group} is not the plan's generation "
            f"TP group {planned.gen_tp_group}; the training layout's rank order must put "
            "each generation TP group on consecutive ranks"
        )
