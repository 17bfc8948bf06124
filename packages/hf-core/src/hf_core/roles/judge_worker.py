"""The judge worker: a generative judge's rollout engine in its own role (``reward.judge``).

Like :class:`~hf_core.roles.score_model_worker.ScoreModelWorker` for a reward model, each rank
owns one engine (any registered rollout backend) and scores its shard of the batch; the trainer
adds the ``reward_scores`` it returns to the rule-based reward.  The policy tokenizer decodes the
responses, the judge's own tokenizer encodes the judge prompts.
"""

from __future__ import annotations

import torch

from hf_core.batch import Batch
from hf_core.config import JudgeConfig, TrainerConfig
from hf_core.plugins import get_rollout_engine
from hf_core.protocols import register
from hf_core.rewards import RuleReward
from hf_core.rewards.judge import DEFAULT_TEMPLATE, GenerativeJudge
from hf_core.roles.common import torch_threads
from hf_core.worker import Worker

#: The non-tensor keys a judge reads beside the response tensors.
JUDGE_KEYS = ("raw_prompt", "ground_truth")


class JudgeWorker(Worker):
    """Scores responses with a generating model; returns ``reward_scores`` [B]."""

    def __init__(self, config: TrainerConfig, judge: JudgeConfig) -> None:
        from transformers import AutoTokenizer

        super().__init__()
        torch.set_num_threads(torch_threads(config))
        engine = get_rollout_engine(judge.backend)(
            **{"model_path": str(judge.model_path), **judge.engine}
        )
        self.judge = GenerativeJudge(
            engine,
            AutoTokenizer.from_pretrained(str(judge.model_path), local_files_only=True),
            template=judge.template or DEFAULT_TEMPLATE,
            max_new_tokens=judge.max_new_tokens,
            score_pattern=judge.score_pattern,
            max_score=judge.max_score,
            unparsed_score=judge.unparsed_score,
        )
        policy_tokenizer = AutoTokenizer.from_pretrained(
            str(config.tokenizer_path), local_files_only=True
        )
        self.scorer = RuleReward(self.judge, policy_tokenizer)

    @register("3D_PROTO")
    def compute_scores(self, batch: Batch) -> Batch:
        return Batch({"reward_scores": self.scorer(batch).float()})
