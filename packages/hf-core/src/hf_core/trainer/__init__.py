"""The single-controller trainer and its helpers."""

from hf_core.trainer.checkpoint import CheckpointError
from hf_core.trainer.rl import RLTrainer
from hf_core.trainer.spawning import RoleGroups, spawn_roles

__all__ = ["CheckpointError", "RLTrainer", "RoleGroups", "spawn_roles"]
