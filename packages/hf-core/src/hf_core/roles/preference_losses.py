"""Pairwise preference losses (reward-model Bradley-Terry, DPO) as training-engine losses.

A pair's loss l(h), h = value(chosen) − value(rejected), is nonlinear in both of its rows, but
an engine may put the two rows in different micro-batches or on different data-parallel
ranks, where neither sees its partner.  The gradient of the mini-batch loss is still linear
in the rows' gradients:

    ∇ mean_p l(h_p) = Σ_rows w_row · ∇ value_row,   w_row = side · l'(h_p) / P

(side +1 for the chosen row, −1 for the rejected one, P the pairs in the whole mini-batch).
So the driver first takes each row's value at the step's weights with a no-grad forward
(``compute_scores`` for a reward model; for DPO ``compute_log_probs`` of the policy, summed
over the response with :func:`sequence_log_probs`, beside the reference's), computes the
weights with :func:`pair_row_weights` and stores them under :data:`PAIR_WEIGHT_KEY`.  Each
micro-batch's loss is then the linear surrogate Σ w_row · value_row (x DP size, since ranks
average their gradients): summed over micro-batches and averaged over ranks its gradient is
the exact gradient of the mean pair loss, however the rows are split.  The pair losses and
metrics (:func:`~hf_core.algorithms.preference.pair_metrics`, ``dpo_metrics``) are reported
from the same pre-step values: no micro-batch can compute them.

The cost is one extra forward per optimiser step (the driver's no-grad pass).  The weights
hold for the weights they were computed at: recompute them before every optimiser step, and
run that forward as the training forward runs (no dropout), or l'(h) is taken elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, get_args

import torch

from hf_core.algorithms.masked import check_token_shapes, masked_sum
from hf_core.algorithms.preference import DPOLossType, dpo_loss
from hf_core.batch import Batch

PAIR_WEIGHT_KEY = "pair_weight"
"""Per-row float: d(mean pair loss)/d(row value), from :func:`pair_row_weights`."""

PairLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(chosen_values, rejected_values) -> per-pair loss`` ([P] each)."""

PairOutput = Literal["scores", "log_probs"]
PAIR_OUTPUTS: tuple[PairOutput, ...] = get_args(PairOutput)


def sequence_log_probs(log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Σ over response tokens of per-token log-probs [B, T] -> [B]: the log-probability of the
    whole response, which DPO compares.  Padding is selected away (NaN there cannot leak)."""
    check_token_shapes(response_mask, log_probs=log_probs)
    return masked_sum(log_probs, response_mask, dim=-1)


def pair_row_weights(
    chosen_values: torch.Tensor,
    rejected_values: torch.Tensor,
    pair_loss: PairLoss,
    *,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-pair losses [P] and the row weights of the chosen and rejected rows ([P] each):
    d mean_p l / d value, which already carry the side's sign and the 1/P.

    Called on the driver with the pre-step values (detached here); ``pair_loss`` is
    differentiated by autograd on leaf copies in ``dtype`` (float64 by default, so the weights
    add no rounding of their own), also inside ``torch.no_grad``.  For DPO bind the reference
    values into ``pair_loss`` (:func:`dpo_pair_loss`).
    """
    if chosen_values.ndim != 1:
        raise ValueError(
            f"chosen_values must be one value per pair [P], got {tuple(chosen_values.shape)}"
        )
    if rejected_values.shape != chosen_values.shape:
        raise ValueError(
            f"rejected_values has shape {tuple(rejected_values.shape)}, expected "
            f"chosen_values' {tuple(chosen_values.shape)}"
        )
    if chosen_values.numel() == 0:
        raise ValueError("pair_row_weights needs at least one pair, got none")
    chosen = chosen_values.detach().to(dtype).requires_grad_()
    rejected = rejected_values.detach().to(dtype).requires_grad_()
    with torch.enable_grad():
        losses = pair_loss(chosen, rejected)
        if losses.shape != chosen.shape:
            raise ValueError(
                f"pair_loss returned shape {tuple(losses.shape)}, expected one loss per pair "
                f"{tuple(chosen.shape)}"
            )
        grads = torch.autograd.grad(losses.mean(), (chosen, rejected), allow_unused=True)
    chosen_w, rejected_w = (
        torch.zeros_like(leaf) if grad is None else grad
        for grad, leaf in zip(grads, (chosen, rejected), strict=True)
    )
    return losses.detach(), chosen_w.detach(), rejected_w.detach()


def dpo_pair_loss(
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> PairLoss:
    """:func:`~hf_core.algorithms.preference.dpo_loss` as a function of the policy's values
    only, the reference's fixed (they carry no gradient): the ``pair_loss`` of
    :func:`pair_row_weights` for DPO."""
    ref_c, ref_r = ref_chosen.detach(), ref_rejected.detach()

    def loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        return dpo_loss(
            chosen,
            rejected,
            ref_c.to(chosen.dtype),
            ref_r.to(rejected.dtype),
            beta=beta,
            loss_type=loss_type,
            label_smoothing=label_smoothing,
        )

    return loss


def _need(container: Mapping[str, object] | Batch, key: str, what: str, producer: str) -> None:
    if key not in container:
        raise KeyError(f"{what} has no {key!r}: {producer}")


class LinearisedPairLoss:
    """The engine loss of a pairwise preference objective: per micro-batch
    Σ_rows pair_weight · value_row x DP size (see the module docstring for why that is exact).

    ``output``: ``"scores"`` for a reward model (``outputs["scores"]``, one per row) or
    ``"log_probs"`` for DPO (per-token ``outputs["log_probs"]`` summed over the micro-batch's
    ``response_mask``).  The only metric is ``pair_surrogate``, the micro-batch's Σ w·value: its
    value means nothing, its gradient is the loss's; the driver reports the pair losses and
    accuracies from the values it computed the weights with.
    """

    def __init__(self, output: PairOutput) -> None:
        if output not in PAIR_OUTPUTS:
            raise ValueError(f"output must be one of {PAIR_OUTPUTS}, got {output!r}")
        self.output = output

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], mb: Batch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        producer = "the driver puts the rows' weights there (pair_row_weights, pre-step values)"
        _need(mb, PAIR_WEIGHT_KEY, "the micro-batch", producer)
        _need(mb.meta, "dp_size", "micro_batch.meta", "the training engine fills it")
        if self.output == "scores":
            _need(outputs, "scores", "the model outputs", "a reward model's score head gives it")
            values = outputs["scores"]
        else:
            _need(outputs, "log_probs", "the model outputs", "the policy's forward gives it")
            _need(mb, "response_mask", "the micro-batch", "DPO sums log-probs over it")
            values = sequence_log_probs(outputs["log_probs"], mb["response_mask"])
        weights = mb[PAIR_WEIGHT_KEY]
        if values.shape != weights.shape:
            raise ValueError(
                f"{PAIR_WEIGHT_KEY!r} has shape {tuple(weights.shape)} but the micro-batch's "
                f"values ({self.output}) have shape {tuple(values.shape)}: one weight per row"
            )
        # The weights may be float64 and the values 16-bit: multiply in the wider dtype.
        dtype = torch.promote_types(torch.promote_types(values.dtype, weights.dtype), torch.float32)
        surrogate = (weights.to(dtype) * values.to(dtype)).sum()
        dp_size = int(mb.meta["dp_size"])
        return surrogate * dp_size, {"pair_surrogate": float(surrogate.detach())}
