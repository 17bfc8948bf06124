"""How many tokens one sequence served by the rollout engine may hold.

Two things bound it: the model's positions (``max_position_embeddings``, extended by RoPE
scaling) and the rollout engine's own limit (a length limit, or one sequence's share of a
KV cache of fixed size, which engines declare through
:class:`~hf_core.engines.capabilities.DeclaresSequenceCapacity`).  The pre-start check
(:mod:`hf_core.trainer.sequence_length`) refuses a recipe whose longest sequence passes
either, and the agent endpoint refuses a prompt that could never be served before it is
batched with other trajectories' requests; both read the bounds here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_core.config import TrainerConfig
from hf_core.engines.capabilities import DeclaresSequenceCapacity
from hf_core.engines.hf_folder import read_model_config
from hf_core.planner.models import from_hf_config
from hf_core.plugins import validated_engine_settings
from hf_core.resharding import GenerationLayout
from hf_core.roles.common import rollout_engine_args


@dataclass(frozen=True)
class SequenceBounds:
    """The bounds on one sequence's tokens, each ``None`` where nothing fixes it."""

    positions: int | None
    """The model's positions (RoPE scaling included)."""
    engine: tuple[int, str] | None
    """The rollout engine's limit and the setting that sets it."""

    @property
    def capacity(self) -> int | None:
        """The tightest bound, or ``None`` when neither applies."""
        known = [b for b in (self.positions, self.engine[0] if self.engine else None) if b]
        return min(known) if known else None


def model_positions(text: dict[str, Any]) -> int | None:
    """The positions a (text) model config covers: ``max_position_embeddings``, times a
    RoPE scaling ``factor`` when it extends them (YaRN, linear, dynamic)."""
    positions = text.get("max_position_embeddings")
    if not isinstance(positions, int):
        return None
    scaling = text.get("rope_scaling") or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if isinstance(factor, (int, float)) and factor > 1:
        original = scaling.get("original_max_position_embeddings") or positions
        return max(positions, int(original * factor))
    return positions


def sequence_bounds(config: TrainerConfig, generation: GenerationLayout) -> SequenceBounds:
    """The recipe's actor model's positions and its rollout engine's limit (the engine as
    the run's resolved ``generation`` layout builds it)."""
    folder = config.role_model(config.actor)
    hf = read_model_config(folder, key="model.path")
    positions = model_positions(hf.get("text_config") or hf)
    rollout = config.rollout
    settings = validated_engine_settings(
        "rollout",
        rollout.backend,
        lambda: {**rollout_engine_args(config, generation), **rollout.engine},
    )
    engine = None
    if isinstance(settings, DeclaresSequenceCapacity):
        spec = from_hf_config(hf, name=str(folder))
        engine = settings.sequence_capacity(2 * spec.num_layers * spec.kv_dim)
    return SequenceBounds(positions, engine)
