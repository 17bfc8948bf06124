"""Loss functions core hands to training engines, built from :mod:`hf_core.algorithms`.

Engines call a loss once per micro-batch and sum the gradients; data-parallel ranks then
average them.  So each micro-batch's aggregated loss is rescaled by its share of the global
mini-batch (tokens for ``token-mean``, sequences otherwise) times the DP size, which makes an
update on any number of ranks and micro-batches equal to one step on the whole mini-batch.
The engine provides the totals in ``micro_batch.meta`` (``dp_size``, ``global_batch_size``,
``global_response_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hf_core.algorithms import (
    PolicyLossConfig,
    entropy_bonus,
    get_policy_loss,
    kl_loss,
    value_loss,
)
from hf_core.batch import Batch
from hf_core.config import AlgorithmConfig


def global_share(micro_batch: Batch, loss_agg_mode: str) -> float:
    """The factor turning a micro-batch mean into its share of the global mean (x DP size)."""
    meta = micro_batch.meta
    if loss_agg_mode == "token-mean":
        tokens = float(micro_batch["response_mask"].sum())
        return tokens * meta["dp_size"] / max(1.0, float(meta["global_response_tokens"]))
    return len(micro_batch) * meta["dp_size"] / max(1, int(meta["global_batch_size"]))


class PolicyLoss:
    """Clipped policy loss − entropy bonus (+ KL-to-reference when ``kl.mode == in_loss``)."""

    def __init__(self, algo: AlgorithmConfig) -> None:
        self.algo = algo
        self.policy_loss = get_policy_loss(algo.policy_loss)
        self.config = PolicyLossConfig(
            clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high,
            clip_ratio_c=algo.clip_ratio_c,
            loss_agg_mode=algo.loss_agg_mode,
        )

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], mb: Batch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["response_mask"]
        mode = self.algo.loss_agg_mode
        loss, metrics = self.policy_loss(
            outputs["log_probs"], mb["old_log_probs"], mb["advantages"], mask, self.config
        )
        if self.algo.entropy_coef > 0:
            loss, extra = entropy_bonus(
                loss, outputs["entropy"], mask, self.algo.entropy_coef, loss_agg_mode=mode
            )
            metrics.update(extra)
        elif "entropy" in outputs:
            entropy = outputs["entropy"].detach()
            metrics["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
        if self.algo.kl.mode == "in_loss":
            kl, extra = kl_loss(
                outputs["log_probs"],
                mb["ref_log_probs"],
                mask,
                estimator=self.algo.kl.estimator,
                loss_agg_mode=mode,
            )
            loss = loss + self.algo.kl.coef * kl
            metrics.update(extra)
        return loss * global_share(mb, mode), metrics


class ValueLoss:
    """PPO's clipped value loss against the returns computed on the driver."""

    def __init__(self, algo: AlgorithmConfig) -> None:
        self.algo = algo

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], mb: Batch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = value_loss(
            outputs["values"],
            mb["old_values"],
            mb["returns"],
            mb["response_mask"],
            clip_range=self.algo.value_clip,
            loss_agg_mode=self.algo.loss_agg_mode,
        )
        return loss * global_share(mb, self.algo.loss_agg_mode), metrics


def sft_loss(
    outputs: Mapping[str, torch.Tensor], mb: Batch
) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the target tokens, token mean over the global batch."""
    mask = mb["response_mask"].to(outputs["log_probs"].dtype)
    nll = -(outputs["log_probs"] * mask).sum() / mask.sum().clamp(min=1)
    return nll * global_share(mb, "token-mean"), {"sft_nll": float(nll.detach())}
