"""The run's parallel layout, resolved once from the recipe.

A recipe says it in two places only: ``<role>.parallel: {tp, pp, sp}`` (how each model
role's training engine splits one replica, and each sequence) and ``rollout.tensor_parallel_size`` /
``rollout.pipeline_parallel_size`` (how many ranks form one rollout engine, the
3D-HybridEngine's ``t_g`` / ``p_g``).  This module is the only reader of those keys: the engine
arguments, the pre-start checks, the memory check, the worker mesh and the auto-mapping
planner all take the :class:`RunLayout` it returns, so the layout a hand-written recipe states
and the one the planner writes into its applied recipe are the same object.

:func:`resolve_layout` runs once per recipe, where the recipe is checked
(:func:`hf_core.trainer.preflight.preflight`, which the CLI's loader and the trainer call);
everything after takes that :class:`RunLayout` as an argument -- placement, the role workers
(it travels to them with their config) and the engine arguments -- instead of reading the
recipe again.  ``placement.mode: auto`` swaps it for the planner's layout once, which states
the same as resolving the applied recipe would.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_core.config.schema import ModelRoleConfig, TrainerConfig
from hf_core.resharding import GenerationLayout

ENGINE_LAYOUT_SETTINGS = {
    "tp": "tensor_parallel_size",
    "pp": "pipeline_parallel_size",
    "sp": "sequence_parallel_size",
    "ep": "expert_parallel_size",
}
"""The engine argument each parallel axis reaches an engine as (for the axes it declares)."""
MODEL_AXES = frozenset({"tp", "pp"})
"""The axes that split a model's weights (``sp`` splits each sequence's tokens)."""


@dataclass(frozen=True)
class TrainingLayout:
    """One role's training split: ``tp`` tensor-parallel ranks x ``pp`` pipeline stages per
    replica, and ``sp`` sequence-parallel ranks sharing each data chunk (Ulysses); the
    data-parallel size is what is left of the role's pool."""

    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    """Expert-parallel ranks (inside the data-parallel ones: the pool still divides by
    ``ranks_per_chunk``, each expert-parallel rank gets its own data)."""

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica's weights are split over (sequence parallelism splits
        tokens, not weights)."""
        return self.tp * self.pp

    @property
    def ranks_per_chunk(self) -> int:
        """Ranks that receive the same data chunk: the role's pool divides by this."""
        return self.tp * self.pp * self.sp


@dataclass(frozen=True)
class RunLayout:
    """Each model role's training layout (by recipe key) and the rollout's generation layout."""

    training: tuple[tuple[str, TrainingLayout], ...]
    generation: GenerationLayout

    def role(self, key: str) -> TrainingLayout:
        """The training layout of the role at recipe key ``key`` (e.g. ``actor``)."""
        for name, layout in self.training:
            if name == key:
                return layout
        raise KeyError(
            f"the run has no model role {key!r} (it has {[k for k, _ in self.training]})"
        )


def model_roles(config: TrainerConfig) -> dict[str, ModelRoleConfig]:
    """The model roles the recipe configures, by recipe key."""
    found = {
        "actor": config.actor,
        "reference": config.reference,
        "teacher": config.teacher,
        "critic": config.critic,
        "reward.model": config.reward.model,
        "cost.model": config.cost.model if config.cost is not None else None,
    }
    return {key: role for key, role in found.items() if role is not None}


def _training_layout(role: ModelRoleConfig) -> TrainingLayout:
    """A role's training layout as its recipe section states it."""
    parallel = role.parallel
    return TrainingLayout(tp=parallel.tp, pp=parallel.pp, sp=parallel.sp, ep=parallel.ep)


def _generation_layout(config: TrainerConfig) -> GenerationLayout:
    """The rollout engine's layout ``(p_g, t_g)`` as the recipe states it."""
    return GenerationLayout(
        pp=config.rollout.pipeline_parallel_size, tp=config.rollout.tensor_parallel_size
    )


def resolve_layout(config: TrainerConfig) -> RunLayout:
    """The run's layout.  Raises ``ValueError`` for a layout no placement can run (a
    standalone rollout pool holds whole-model engines only).

    Called once per recipe, by the pre-start checks; its result is handed down from there."""
    generation = _generation_layout(config)
    if config.placement.mode == "standalone" and (generation.tp > 1 or generation.pp > 1):
        raise ValueError(
            "placement.mode: standalone runs one whole-model rollout engine per rank: "
            "rollout.tensor_parallel_size and pipeline_parallel_size must be 1"
        )
    training = tuple((key, _training_layout(role)) for key, role in model_roles(config).items())
    return RunLayout(training=training, generation=generation)


def fixed_sizes(config: TrainerConfig) -> tuple[dict[str, dict[str, int]], int | None]:
    """What the recipe fixed explicitly, for the planner to respect: per role key the
    ``parallel`` sizes it set (``{"tp": 2}``), and ``t_g`` when ``rollout.tensor_parallel_size``
    was set."""
    roles = {
        key: {axis: getattr(role.parallel, axis) for axis in role.parallel.model_fields_set}
        for key, role in model_roles(config).items()
        if "parallel" in role.model_fields_set
    }
    rollout = config.rollout
    tg = (
        rollout.tensor_parallel_size if "tensor_parallel_size" in rollout.model_fields_set else None
    )
    return roles, tg


def with_layout(data: dict, layout: RunLayout) -> dict:
    """A recipe (as a plain dict, e.g. ``TrainerConfig.model_dump()``) stating ``layout``:
    each role's ``parallel`` and the rollout's sizes.  The planner writes its plan with this."""
    for key, sizes in layout.training:
        section = data
        for part in key.split("."):
            section = section[part]
        section["parallel"] = {"tp": sizes.tp, "pp": sizes.pp, "sp": sizes.sp, "ep": sizes.ep}
    data["rollout"]["tensor_parallel_size"] = layout.generation.tp
    data["rollout"]["pipeline_parallel_size"] = layout.generation.pp
    return data
