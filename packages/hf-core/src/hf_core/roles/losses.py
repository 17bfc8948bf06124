"""Loss functions core hands to training engines, built from :mod:`hf_core.algorithms`.

Engines call a loss once per micro-batch and sum the gradients; data-parallel ranks then
average them.  So each micro-batch returns its *share* of the loss over the global mini-batch
times the DP size, which makes an update on any number of ranks and micro-batches equal to one
step on the whole mini-batch, however its rows (empty ones included) fall:

* ``token-mean``: the micro-batch's token mean x its tokens / the mini-batch's tokens;
* the ``seq-mean-*`` modes: its sequence mean x its non-empty rows / the mini-batch's
  non-empty rows (a row masked out whole weighs nothing anywhere), with the constant L of
  ``seq-mean-token-sum-norm`` the mini-batch's response width (micro-batches are trimmed);
* ``group-mean-token-mean``: each row is first weighted by its group's tokens in this
  micro-batch / the group's tokens in the mini-batch, which turns the micro-batch's per-group
  token means into shares of the global ones; then x its groups / the mini-batch's groups
  (groups with tokens).  The rows need ``group_index``;
* any other registered mode: x its rows / the mini-batch's rows.

The engine provides the totals in ``micro_batch.meta`` (``dp_size`` and the counts of
:mod:`hf_core.engines.loss_totals`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from hf_core.algorithms import (
    PolicyLossConfig,
    entropy_bonus,
    get_policy_loss,
    kl_loss,
    masked_mean,
    value_loss,
)
from hf_core.algorithms.distill_top_k import TopKLoss, top_k_distill_loss
from hf_core.batch import Batch
from hf_core.config import AlgorithmConfig, TrainerConfig
from hf_core.config.schema import DistillConfig
from hf_core.engines.loss_totals import GROUP_KEY
from hf_core.engines.top_k import (
    LOG_PROBS_AT_TEACHER_TOP_K,
    TEACHER_TOP_K_IDS,
    TEACHER_TOP_K_LOG_PROBS,
)
from hf_core.roles.loss_advice import loss_agg_mode_advice

log = logging.getLogger(__name__)

MISMATCH_MEAN = "rollout/logprob_abs_diff_mean"
MISMATCH_MAX = "rollout/logprob_abs_diff_max"
MISMATCH_SUM = "rollout/logprob_abs_diff_sum"
MISMATCH_TOKENS = "rollout/logprob_tokens_sum"
"""The rollout engine's log-probs against the training engine's, per response token."""

RolloutISMode = Literal["truncated", "masked", "seq_truncated", "seq_masked"]
"""Rollout corrections: per token (``truncated``, ``masked``) or per sequence (``seq_*``)."""
SEQUENCE_IS_MODES = ("seq_truncated", "seq_masked")

SEQUENCE_MEAN_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
GROUP_MEAN_MODE = "group-mean-token-mean"


def _meta_count(micro_batch: Batch, key: str, mode: str) -> Any:
    if key not in micro_batch.meta:
        raise KeyError(
            f"micro_batch.meta has no {key!r}, which loss_agg_mode {mode!r} scales by: the "
            "training engine must fill the meta with hf_core.engines.loss_totals"
        )
    return micro_batch.meta[key]


def _group_ids(micro_batch: Batch) -> torch.Tensor:
    if GROUP_KEY not in micro_batch:
        raise KeyError(
            f"loss_agg_mode {GROUP_MEAN_MODE!r} needs the group id of every row: the update "
            f"batch has no {GROUP_KEY!r}"
        )
    return micro_batch[GROUP_KEY].to(torch.int64)


def global_share(micro_batch: Batch, loss_agg_mode: str) -> float:
    """The factor turning a micro-batch's aggregate into its share of the global mini-batch's
    (x DP size); see the module docstring for what each mode counts."""
    dp_size = int(_meta_count(micro_batch, "dp_size", loss_agg_mode))
    valid = micro_batch["response_mask"] != 0
    if loss_agg_mode == "token-mean":
        part, key = int(valid.sum()), "global_response_tokens"
    elif loss_agg_mode in SEQUENCE_MEAN_MODES:
        part, key = int(valid.any(dim=-1).sum()), "global_nonempty_rows"
    elif loss_agg_mode == GROUP_MEAN_MODE:
        ids = _group_ids(micro_batch)[valid.any(dim=-1)]
        groups = _meta_count(micro_batch, "global_group_tokens", loss_agg_mode)
        return ids.unique().numel() * dp_size / max(1, sum(1 for n in groups if n))
    else:
        part, key = len(micro_batch), "global_batch_size"
    return part * dp_size / max(1, int(_meta_count(micro_batch, key, loss_agg_mode)))


def group_row_weights(micro_batch: Batch, dtype: torch.dtype) -> torch.Tensor:
    """Per-row weights [B] of ``group-mean-token-mean``: the row's group's response tokens in
    this micro-batch / in the global mini-batch (``meta["global_group_tokens"]``).

    Weighting each row's per-token losses so turns the micro-batch's token mean of a group
    into its share of the group's mini-batch token mean; rows without tokens get 0.
    """
    ids = _group_ids(micro_batch)
    totals = torch.as_tensor(
        _meta_count(micro_batch, "global_group_tokens", GROUP_MEAN_MODE), dtype=torch.int64
    ).to(ids.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= totals.numel()):
        raise ValueError(
            f"{GROUP_KEY!r} holds ids {int(ids.min())}..{int(ids.max())} but "
            f"meta['global_group_tokens'] counts groups 0..{totals.numel() - 1}"
        )
    row_tokens = (micro_batch["response_mask"] != 0).sum(dim=-1).to(torch.int64)
    local = torch.zeros_like(totals).index_add_(0, ids, row_tokens)
    if bool((local > totals).any()):
        raise ValueError(
            "meta['global_group_tokens'] counts fewer tokens for a group than this micro-batch "
            "holds: the engine's totals do not cover the whole mini-batch"
        )
    weights = local[ids].to(dtype) / totals[ids].clamp_min(1).to(dtype)
    return torch.where(row_tokens > 0, weights, torch.zeros((), dtype=dtype))


@dataclass(frozen=True)
class MicroBatchScaling:
    """How a micro-batch's losses are aggregated so that they add up to the global loss:
    ``share`` (see :func:`global_share`), the group ids and per-row weights of the group mode,
    and the constant L of ``seq-mean-token-sum-norm``."""

    share: float
    index: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None
    norm_length: float | None = None

    def mask(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` with the per-row weights on it (the aggregation reads mask values as
        token weights)."""
        if self.row_weights is None:
            return mask
        return mask.to(dtype) * self.row_weights[:, None].to(dtype)

    def aggregation(self) -> dict[str, Any]:
        """Keyword arguments of the aggregated loss terms (``index``, ``norm_length``)."""
        return {"index": self.index, "norm_length": self.norm_length}


def micro_batch_scaling(
    micro_batch: Batch,
    loss_agg_mode: str,
    dtype: torch.dtype,
    norm_length: float | None = None,
) -> MicroBatchScaling:
    """The :class:`MicroBatchScaling` of ``micro_batch`` under ``loss_agg_mode``;
    ``norm_length``: a fixed L for ``seq-mean-token-sum-norm`` (default: the mini-batch's
    response width, ``meta["global_response_length"]``)."""
    share = global_share(micro_batch, loss_agg_mode)
    if loss_agg_mode == GROUP_MEAN_MODE:
        weights = group_row_weights(micro_batch, dtype)
        return MicroBatchScaling(share, _group_ids(micro_batch), weights)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if norm_length is None:
            key = "global_response_length"
            norm_length = float(_meta_count(micro_batch, key, loss_agg_mode))
        return MicroBatchScaling(share, norm_length=norm_length)
    return MicroBatchScaling(share)


HALF_PRECISION = ("bfloat16", "float16", "bf16", "fp16", "half")
HALF_DTYPES = (torch.bfloat16, torch.float16)
DTYPE_KEYS = ("param_dtype", "mixed_precision", "dtype")
"""Engine settings naming a dtype, in every backend's ``engine:`` block."""


def runs_in_half_precision(config: TrainerConfig) -> bool:
    """Whether the actor's or the rollout engine's settings name a 16-bit float: their
    log-probs then differ by rounding, not only by summation order."""
    blocks = (config.actor.engine, config.rollout.engine)
    return any(str(block.get(key)) in HALF_PRECISION for block in blocks for key in DTYPE_KEYS)


def rollout_is_mode(
    config: TrainerConfig,
    actor_dtype: torch.dtype = torch.float32,
    rollout_dtype: torch.dtype | None = None,
) -> RolloutISMode | None:
    """The rollout correction in force, or ``None`` when it is off.

    ``algorithm.rollout_is: auto`` turns truncated weights on when the samples may come from
    an older policy than the one being updated (``rollout.max_staleness`` > 0) or when the
    engines run in 16-bit floats (the training / inference mismatch): settings that name one,
    or engines whose resolved dtype is one (FSDP's ``mixed_precision: auto`` on a GPU, a
    rollout engine's ``dtype: auto`` where the device computes bfloat16).
    """
    mode = config.algorithm.rollout_is
    if mode == "auto":
        resolved = (actor_dtype, rollout_dtype)
        half = runs_in_half_precision(config) or any(d in HALF_DTYPES for d in resolved)
        return "truncated" if config.rollout.max_staleness > 0 or half else None
    return None if mode == "none" else mode


def rollout_is_cap(
    config: TrainerConfig,
    actor_dtype: torch.dtype = torch.float32,
    rollout_dtype: torch.dtype | None = None,
) -> float | None:
    """The cap of the rollout importance ratio, or ``None`` when the correction is off."""
    off = rollout_is_mode(config, actor_dtype, rollout_dtype) is None
    return None if off else config.algorithm.rollout_is_cap


def rollout_is_weights(
    behaviour_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    mode: RolloutISMode = "truncated",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token loss weights from the ratio ``pi_behaviour / pi_rollout``.

    The samples came from the rollout engine's policy (possibly older, or the same weights
    in another precision); the PPO ratio is taken against the training engine's policy
    before this update.  ``truncated``: weight each token's loss by the ratio, capped so one
    unlikely token cannot dominate.  ``masked``: keep tokens whose ratio is inside
    ``[1/cap, cap]`` at weight 1 and drop the others (the engines disagree too much there).
    ``seq_truncated`` / ``seq_masked``: the same per response, every token of a sequence
    getting its weight (see :func:`sequence_is_weights`).
    """
    tokens = mask.bool()
    # Padding is selected away first: whatever it holds cannot reach a sum or a metric.
    log_ratio = torch.where(tokens, (behaviour_log_probs - rollout_log_probs).detach(), 0.0)
    if mode in SEQUENCE_IS_MODES:
        return sequence_is_weights(log_ratio, mask, cap, mode)
    ratio = torch.exp(log_ratio.clamp(max=20.0))
    outside = (ratio > cap) | (ratio < 1.0 / cap)
    if mode == "masked":
        weights = (~outside).to(mask.dtype) * mask
    else:
        weights = ratio.clamp(max=cap) * mask
    kept = ratio[tokens]
    return weights, {
        "is_weight_mean": float(weights[tokens].mean()) if kept.numel() else 1.0,
        "is_weight_max": float(kept.max()) if kept.numel() else 1.0,
        "is_clip_frac": float((kept > cap).float().mean()) if kept.numel() else 0.0,
        "is_masked_frac": float(outside[tokens].float().mean())
        if mode == "masked" and kept.numel()
        else 0.0,
    }


_SEQUENCE_IS_METRICS = ("is_clip_frac", "is_masked_frac", "is_seq_clip_frac", "is_seq_masked_frac")
_NO_WEIGHTS = {"is_weight_mean": 1.0, "is_weight_max": 1.0}


def sequence_is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, cap: float, mode: RolloutISMode
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sequence rollout correction from per-token ``log(pi_behaviour / pi_rollout)``.

    ``seq_truncated``: the sequence's importance weight, the product of its token ratios
    exp(sum_t log_ratio), truncated at ``cap`` and put on every token of the sequence: the
    likelihood ratio of the whole sampled response, unbiased before truncation.
    ``seq_masked``: a sequence is dropped when its *geometric-mean* ratio
    exp(mean_t log_ratio) leaves ``[1/cap, cap]``; the length normalisation (as in GSPO's
    sequence ratio) keeps one band meaningful for short and long responses alike, where the
    product's spread grows with length and would drop long responses for length alone.
    An empty row keeps ratio 1 and weight 0.  Metrics: the token-level keys of
    :func:`rollout_is_weights` (``is_weight_max`` is the largest sequence ratio) plus
    ``is_seq_clip_frac`` (share of non-empty sequences whose ratio exceeds ``cap``) and
    ``is_seq_masked_frac`` (share dropped).
    """
    tokens = mask.bool()
    rows = tokens.any(dim=-1)
    if mode == "seq_truncated":
        seq_log_ratio = log_ratio.sum(dim=-1)
    else:
        seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)
    seq_ratio = torch.exp(seq_log_ratio.clamp(max=20.0))
    above = seq_ratio > cap
    outside = above | (seq_ratio < 1.0 / cap)
    dtype = seq_ratio.dtype
    if mode == "seq_masked":
        per_sequence = (~outside).to(dtype)
        dropped = outside
    else:
        per_sequence = seq_ratio.clamp(max=cap)
        dropped = torch.zeros_like(outside)
    weights = per_sequence[:, None] * tokens.to(dtype)
    if not rows.any():
        return weights, dict.fromkeys(_SEQUENCE_IS_METRICS, 0.0) | _NO_WEIGHTS
    per_token = tokens.sum(dim=-1).to(dtype)
    n_tokens = float(per_token.sum())
    return weights, {
        "is_weight_mean": float(weights[tokens].mean()),
        "is_weight_max": float(seq_ratio[rows].max()),
        "is_clip_frac": float((above.to(dtype) * per_token).sum()) / n_tokens,
        "is_masked_frac": float((dropped.to(dtype) * per_token).sum()) / n_tokens,
        "is_seq_clip_frac": float(above[rows].to(dtype).mean()),
        "is_seq_masked_frac": float(dropped[rows].to(dtype).mean()),
    }


class PolicyLoss:
    """Clipped policy loss − entropy bonus (+ KL-to-reference when ``kl.mode == in_loss``, +
    KL-to-teacher when the batch carries ``teacher_log_probs``: ``algorithm.distill.mode:
    loss``, + the top-k divergence to the teacher when it carries the teacher's top-k:
    ``algorithm.distill.loss: forward_kl_topk | jsd``), with importance weights against the
    rollout policy (``is_mode``) when ``is_cap`` is set.

    ``norm_length``: a fixed L for ``seq-mean-token-sum-norm`` (e.g. ``rollout.max_new_tokens``;
    default: the mini-batch's response width).  Warns (:func:`loss_agg_mode_advice`) when the
    policy loss's source uses another aggregation than ``algo.loss_agg_mode``.  Under
    ``group-mean-token-mean`` the row weights (:func:`group_row_weights`) scale the advantages
    and the other terms' mask, so ``pg_loss``, ``entropy`` and ``kl_loss`` are then the
    micro-batch's weighted values; ``pg_clipfrac`` and ``ppo_kl`` stay plain token means."""

    def __init__(
        self,
        algo: AlgorithmConfig,
        *,
        is_cap: float | None = None,
        is_mode: RolloutISMode = "truncated",
        norm_length: float | None = None,
    ) -> None:
        self.algo = algo
        self.is_cap = is_cap
        self.is_mode = is_mode
        self.norm_length = norm_length
        self.policy_loss = get_policy_loss(algo.policy_loss)
        advice = loss_agg_mode_advice(algo)
        if advice is not None:
            log.warning(advice)
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
        log_probs = outputs["log_probs"]
        scaling = micro_batch_scaling(mb, mode, log_probs.dtype, self.norm_length)
        if "old_log_probs" in mb:
            old_log_probs = mb["old_log_probs"]
            metrics: dict[str, float] = {}
        else:  # on-policy: this forward is the behaviour policy (ratio 1)
            old_log_probs = log_probs.detach()
            metrics = mismatch_parts(old_log_probs, mb["rollout_log_probs"], mask)
        advantages = mb["advantages"]
        if self.is_cap is not None:
            # Scaling the advantage by w >= 0 scales every term of the (dual-)clipped
            # objective by w: the same as weighting each token's loss.
            weights, is_metrics = rollout_is_weights(
                old_log_probs, mb["rollout_log_probs"], mask, self.is_cap, self.is_mode
            )
            advantages = advantages * weights
            metrics.update(is_metrics)
        if scaling.row_weights is not None:  # the group mode's row weights, the same way
            advantages = advantages * scaling.row_weights[:, None].to(advantages.dtype)
        config = self.config
        if scaling.norm_length is not None:
            config = config.model_copy(update={"norm_length": scaling.norm_length})
        groups = {} if scaling.index is None else {"index": scaling.index}
        loss, pg_metrics = self.policy_loss(
            log_probs, old_log_probs, advantages, mask, config, **groups
        )
        metrics.update(pg_metrics)
        # the other terms carry the row weights on their mask (their metrics are the terms)
        term_mask = scaling.mask(mask, log_probs.dtype)
        if self.algo.entropy_coef > 0:
            loss, extra = entropy_bonus(
                loss,
                outputs["entropy"],
                term_mask,
                self.algo.entropy_coef,
                loss_agg_mode=mode,
                **scaling.aggregation(),
            )
            metrics.update(extra)
        elif "entropy" in outputs:
            entropy = outputs["entropy"].detach()
            metrics["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
        if self.algo.kl.mode == "in_loss":
            kl, extra = kl_loss(
                outputs["log_probs"],
                mb["ref_log_probs"],
                term_mask,
                estimator=self.algo.kl.estimator,
                loss_agg_mode=mode,
                **scaling.aggregation(),
            )
            loss = loss + self.algo.kl.coef * kl
            metrics.update(extra)
        if "teacher_log_probs" in mb:  # on-policy distillation as a loss term
            distill = self.algo.distill
            kl, _ = kl_loss(
                outputs["log_probs"],
                mb["teacher_log_probs"],
                term_mask,
                estimator=distill.estimator,
                loss_agg_mode=mode,
                **scaling.aggregation(),
            )
            loss = loss + distill.coef * kl
            metrics["distill_loss"] = float(kl.detach())
        if TEACHER_TOP_K_LOG_PROBS in mb:  # the teacher's top-k distribution as a loss term
            distill = self.algo.distill
            divergence, extra = top_k_distill_loss(
                outputs[LOG_PROBS_AT_TEACHER_TOP_K],
                mb[TEACHER_TOP_K_LOG_PROBS],
                term_mask,
                loss=cast(TopKLoss, distill.loss),
                beta=distill.beta,
                tail=distill.tail,
                loss_agg_mode=mode,
                **scaling.aggregation(),
            )
            loss = loss + distill.coef * divergence
            metrics["distill_loss"] = float(divergence.detach())
            metrics.update(extra)
        return loss * scaling.share, metrics


def distill_loss_keys(distill: DistillConfig) -> tuple[str, ...]:
    """The teacher's batch keys :class:`PolicyLoss` reads: its log-probs of the sampled
    tokens (``reverse_kl`` in the loss), its top-k (the top-k losses), or none
    (``reverse_kl`` in the advantage)."""
    if distill.loss != "reverse_kl":
        return (TEACHER_TOP_K_IDS, TEACHER_TOP_K_LOG_PROBS)
    return ("teacher_log_probs",) if distill.mode == "loss" else ()


def mismatch_parts(
    log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Sum, count and maximum of |training - rollout| log-probs over this micro-batch's
    response tokens (sums combine exactly across micro-batches and ranks)."""
    diff = (log_probs - rollout_log_probs).abs()[mask.bool()]
    return {
        MISMATCH_SUM: float(diff.sum()),
        MISMATCH_TOKENS: float(diff.numel()),
        MISMATCH_MAX: float(diff.max()) if diff.numel() else 0.0,
    }


def mismatch_summary(parts: dict[str, float]) -> dict[str, float]:
    """The logged mismatch (token mean and maximum) from :func:`mismatch_parts`' sums."""
    tokens = parts.get(MISMATCH_TOKENS)
    if not tokens:
        return {}
    return {MISMATCH_MEAN: parts[MISMATCH_SUM] / tokens, MISMATCH_MAX: parts[MISMATCH_MAX]}


class ValueLoss:
    """PPO's clipped value loss against the returns computed on the driver.

    Under ``group-mean-token-mean`` the row weights ride on the mask, so ``vf_clipfrac`` and
    ``vpred_mean`` are then means weighted like the loss."""

    def __init__(self, algo: AlgorithmConfig, *, norm_length: float | None = None) -> None:
        self.algo = algo
        self.norm_length = norm_length

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], mb: Batch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mode = self.algo.loss_agg_mode
        values = outputs["values"]
        scaling = micro_batch_scaling(mb, mode, values.dtype, self.norm_length)
        loss, metrics = value_loss(
            values,
            mb["old_values"],
            mb["returns"],
            scaling.mask(mb["response_mask"], values.dtype),
            clip_range=self.algo.value_clip,
            loss_agg_mode=mode,
            **scaling.aggregation(),
        )
        return loss * scaling.share, metrics


def sft_loss(
    outputs: Mapping[str, torch.Tensor], mb: Batch
) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the target tokens, token mean over the global batch.

    ``sft_nll`` is the micro-batch's mean; ``sft_nll_sum`` / ``sft_tokens_sum`` add up over
    micro-batches and ranks, so their ratio is the step's exact token mean."""
    mask = mb["response_mask"].to(outputs["log_probs"].dtype)
    total = -(outputs["log_probs"] * mask).sum()
    nll = total / mask.sum().clamp(min=1)
    metrics = {
        "sft_nll": float(nll.detach()),
        "sft_nll_sum": float(total.detach()),
        "sft_tokens_sum": float(mask.sum()),
    }
    return nll * global_share(mb, "token-mean"), metrics
