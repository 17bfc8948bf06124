"""Role workers: core's actor/rollout/reference, critic and reward/cost model workers.

They hold engines chosen by name (plugins) and expose ``@register``-ed methods the trainer
calls through worker groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_core.lazy_imports import lazy_exports

if TYPE_CHECKING:
    from hf_core.roles.actor import ActorRolloutRefWorker
    from hf_core.roles.critic import CriticWorker
    from hf_core.roles.judge_worker import JUDGE_KEYS, JudgeWorker
    from hf_core.roles.rollout_pool import RolloutWorker
    from hf_core.roles.score_model_worker import ScoreModelWorker

__all__ = [
    "JUDGE_KEYS",
    "ActorRolloutRefWorker",
    "CriticWorker",
    "JudgeWorker",
    "RolloutWorker",
    "ScoreModelWorker",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "actor": ("ActorRolloutRefWorker",),
        "critic": ("CriticWorker",),
        "judge_worker": ("JUDGE_KEYS", "JudgeWorker"),
        "rollout_pool": ("RolloutWorker",),
        "score_model_worker": ("ScoreModelWorker",),
    },
)
