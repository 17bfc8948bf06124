"""The reference policy of an actor that trains LoRA adapters, for free.

When the recipe's reference policy is the actor's own base weights, the actor with its
adapters disabled computes it -- the base weights are in memory once, not twice.  (What a LoRA
actor syncs into its rollout engine is :mod:`hf_core.sync.lora`.)
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from hf_core.config import TrainerConfig
from hf_core.engines import TrainingEngine, TrainsAdapters
from hf_core.sync import lora_of


def reference_is_actor_base(config: TrainerConfig, actor: TrainingEngine) -> bool:
    """Whether the reference policy is the LoRA actor's own base model (the same backend and
    weights): then it is the actor with adapters disabled, and no reference engine is built."""
    reference = config.reference
    if reference is None or lora_of(actor) is None:
        return False
    return reference.backend == config.actor.backend and config.role_model(
        reference
    ) == config.role_model(config.actor)


def base_model(actor: TrainingEngine) -> AbstractContextManager[None]:
    """A scope in which the LoRA actor computes as its base model."""
    if not isinstance(actor, TrainsAdapters):
        raise TypeError(f"{type(actor).__name__} trains no adapters: it has no base model scope")
    return actor.adapters_disabled()
