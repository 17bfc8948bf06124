"""Role workers: core's actor/rollout/reference, critic and reward/cost model workers.

They hold engines chosen by name (plugins) and expose ``@register``-ed methods the trainer
calls through worker groups.
"""

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
