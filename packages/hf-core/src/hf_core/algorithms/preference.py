"""Pairwise preference losses: Bradley-Terry for reward models, DPO (sigmoid and IPO).

Sources:
* Bradley-Terry reward-model loss — Bradley & Terry 1952; as an RM objective Ouyang et al.
  2022 (InstructGPT, arXiv 2203.02155) eq. 1: −log σ(r_c − r_r).  The optional margin
  follows Llama 2 (Touvron et al. 2023, arXiv 2307.09288 §3.2.2): −log σ(r_c − r_r − m), so
  pairs rated "much better" must be separated by more.
* DPO — Rafailov et al. 2023 (arXiv 2305.18290) eq. 7: −log σ(β·h) with
  h = (log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r)).  Label smoothing ε is the
  "conservative DPO" of Mitchell 2023 ("A note on DPO with noisy preferences"): the label is
  flipped with probability ε, −(1−ε)·log σ(β·h) − ε·log σ(−β·h), which keeps h finite.
* IPO — Azar et al. 2023 (arXiv 2310.12036) eq. 17: (h − 1/(2β))², a squared loss that
  regresses h to a fixed target instead of pushing it to infinity on deterministic
  preferences.

Everything is per pair ([P] in, [P] out): the caller reduces (the engine-side surrogate in
:mod:`hf_core.roles.preference_losses` needs the per-pair values and their derivatives).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.nn.functional as F

DPOLossType = Literal["sigmoid", "ipo"]
DPO_LOSS_TYPES: tuple[DPOLossType, ...] = get_args(DPOLossType)
PREFERENCE_LOSSES = ("bradley_terry", "dpo_sigmoid", "dpo_ipo")
"""The pairwise losses here: a reward model's, and DPO with each ``loss_type``."""


def _check_pair_shapes(**tensors: torch.Tensor) -> None:
    """Every per-pair tensor must have the first one's shape (the message names the culprit)."""
    (first, reference), *rest = tensors.items()
    for name, tensor in rest:
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {first}'s "
                f"{tuple(reference.shape)} (one value per pair)"
            )


def _check_beta(beta: float) -> None:
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a finite number > 0, got {beta}")


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Per-pair −log σ(chosen − rejected − margin): the negative log-likelihood that the
    chosen response wins under a Bradley-Terry model of the scores.

    ``margin``: a float, a 0-d tensor or one value per pair (Llama 2's graded margin);
    ``None`` is 0.  ``logsigmoid`` keeps the loss finite for any score gap.
    """
    _check_pair_shapes(chosen=chosen, rejected=rejected)
    gap = chosen - rejected
    if margin is not None:
        if isinstance(margin, torch.Tensor) and margin.ndim:
            _check_pair_shapes(chosen=chosen, margin=margin)
        elif not isinstance(margin, torch.Tensor) and not math.isfinite(margin):
            raise ValueError(f"margin must be finite, got {margin}")
        gap = gap - margin
    return -F.logsigmoid(gap)


def dpo_log_ratio_margin(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
) -> torch.Tensor:
    """h = (policy_chosen − ref_chosen) − (policy_rejected − ref_rejected), per pair: how much
    more the policy than the reference prefers the chosen response (sequence log-probs)."""
    _check_pair_shapes(
        policy_chosen=policy_chosen,
        policy_rejected=policy_rejected,
        ref_chosen=ref_chosen,
        ref_rejected=ref_rejected,
    )
    return (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-pair DPO loss on summed response log-probs (see the module docstring).

    ``sigmoid``: −(1−ε)·log σ(β·h) − ε·log σ(−β·h), ε = ``label_smoothing`` in [0, 0.5) (at
    0.5 the loss no longer prefers either response).  ``ipo``: (h − 1/(2β))²; label smoothing
    has no meaning there and is an error rather than silently ignored.
    """
    _check_beta(beta)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    h = dpo_log_ratio_margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    if loss_type == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing applies to loss_type 'sigmoid' only, not 'ipo'")
        return (h - 1.0 / (2.0 * beta)).square()
    logits = beta * h
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def _mean(values: torch.Tensor) -> float:
    return float(values.detach().to(torch.float64).mean())


def _check_nonempty(values: torch.Tensor) -> None:
    if values.numel() == 0:
        raise ValueError("preference metrics need at least one pair, got none")


def dpo_metrics(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
) -> dict[str, float]:
    """DPO's implicit rewards β·(log π − log π_ref), averaged over pairs: ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/margin`` (chosen − rejected) and ``rewards/accuracy``
    (share of pairs whose chosen reward is strictly larger; a tie counts as wrong)."""
    _check_beta(beta)
    _check_pair_shapes(
        policy_chosen=policy_chosen,
        policy_rejected=policy_rejected,
        ref_chosen=ref_chosen,
        ref_rejected=ref_rejected,
    )
    _check_nonempty(policy_chosen)
    chosen = beta * (policy_chosen.detach() - ref_chosen.detach())
    rejected = beta * (policy_rejected.detach() - ref_rejected.detach())
    return {
        "rewards/chosen": _mean(chosen),
        "rewards/rejected": _mean(rejected),
        "rewards/margin": _mean(chosen - rejected),
        "rewards/accuracy": _mean(chosen > rejected),
    }


def pair_metrics(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> dict[str, float]:
    """A reward model's pair metrics: ``pair_accuracy`` (share of pairs scored strictly in
    the labelled order; a tie counts as wrong), ``score_margin`` (mean chosen − rejected),
    ``score_chosen`` and ``score_rejected`` (mean scores, to watch the scale drift)."""
    _check_pair_shapes(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    _check_nonempty(chosen_scores)
    chosen, rejected = chosen_scores.detach(), rejected_scores.detach()
    return {
        "pair_accuracy": _mean(chosen > rejected),
        "score_margin": _mean(chosen - rejected),
        "score_chosen": _mean(chosen),
        "score_rejected": _mean(rejected),
    }
