"""The single-controller trainer and its helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_core.lazy_imports import lazy_exports

if TYPE_CHECKING:
    from hf_core.trainer.checkpoint import CheckpointError
    from hf_core.trainer.rl import RLTrainer
    from hf_core.trainer.spawning import RoleGroups, spawn_roles

__all__ = ["CheckpointError", "RLTrainer", "RoleGroups", "spawn_roles"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "checkpoint": ("CheckpointError",),
        "rl": ("RLTrainer",),
        "spawning": ("RoleGroups", "spawn_roles"),
    },
)
