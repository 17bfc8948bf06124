"""The single-controller trainers and their helpers.

``trainer:`` in a recipe picks the dataflow (:func:`trainer_class`): RL (the default),
supervised fine-tuning, reward-model training or DPO, each a
:class:`~hf_core.trainer.run_loop.RunLoop` on the same role workers and engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_core.lazy_imports import lazy_exports

if TYPE_CHECKING:
    from hf_core.trainer.checkpoint import CheckpointError
    from hf_core.trainer.choice import trainer_class
    from hf_core.trainer.preference import DPOTrainer, RewardModelTrainer
    from hf_core.trainer.rl import RLTrainer
    from hf_core.trainer.run_loop import RunLoop
    from hf_core.trainer.sft import SFTTrainer
    from hf_core.trainer.spawning import RoleGroups, spawn_roles

__all__ = [
    "CheckpointError",
    "DPOTrainer",
    "RLTrainer",
    "RewardModelTrainer",
    "RoleGroups",
    "RunLoop",
    "SFTTrainer",
    "spawn_roles",
    "trainer_class",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "checkpoint": ("CheckpointError",),
        "choice": ("trainer_class",),
        "preference": ("DPOTrainer", "RewardModelTrainer"),
        "rl": ("RLTrainer",),
        "run_loop": ("RunLoop",),
        "sft": ("SFTTrainer",),
        "spawning": ("RoleGroups", "spawn_roles"),
    },
)
