"""How a per-token loss matrix [B, T] becomes one scalar.

The choice changes what a long response weighs (DAPO, Yu et al. 2025, arXiv 2503.14476 §3.3;
Dr. GRPO, Liu et al. 2025, arXiv 2503.20783 §3.1), so it is a named, registered option:

* ``token-mean`` — Σ l·m / Σ m over the whole batch: every valid token weighs the same
  (PPO implementations, DAPO's "token-level policy gradient loss").
* ``seq-mean-token-sum`` — mean over sequences of Σ_t l·m: long responses weigh more.
* ``seq-mean-token-mean`` — mean over sequences of the per-sequence token mean: every response
  weighs the same, the 1/|o_i| of the original GRPO objective (Shao et al. 2024, eq. 3).
* ``seq-mean-token-sum-norm`` — mean over sequences of Σ_t l·m / L with a constant L
  (``norm_length``, default T): Dr. GRPO's length-unbiased form.
* ``group-mean-token-mean`` — within each prompt's group, token-mean over all of its responses'
  tokens; then mean over groups.  Every prompt weighs the same and, inside a prompt, every token
  does (DAPO's token-level loss taken per prompt).  Needs group ids.

Sequence means run over sequences with at least one valid token, so an all-padding row (one
masked out whole, e.g. by overlong filtering) does not dilute the loss; group means likewise
skip groups without a valid token.  An all-padding batch aggregates to 0.  Mask values weigh
tokens (``Σ l·m``; a token mean divides by ``Σ m``), while the number of sequences and a
group's token count count non-zero entries (so a weight on a row scales its share of a group
mean, which :mod:`hf_core.roles.losses` uses).

Aggregation is within the tensor it is given.  With micro-batches and data-parallel ranks the
mean over the whole mini-batch is a sum of per-micro-batch shares, which
:mod:`hf_core.roles.losses` builds from these functions and the mini-batch's counts
(:mod:`hf_core.engines.loss_totals`): ``token-mean`` x tokens, the ``seq-mean-*`` modes x
non-empty rows, ``group-mean-token-mean`` with rows weighted by their group's share of its
tokens x groups, each over the mini-batch's count.  So the update does not depend on how rows,
empty ones included, fall into micro-batches.

``seq-mean-token-sum-norm`` divides each sequence's token sum by L and averages over the
sequences (the paper's 1/G).  verl's mode of that name (its ``agg_loss``) instead sums the
sequences' token sums and divides by L only (its ``loss_scale_factor``, default the mask's
width), with no 1/G: its value grows with the number of sequences it is given.
"""

from __future__ import annotations

import torch

from hf_core.algorithms.groups import GroupIndex, group_onehot
from hf_core.algorithms.groups import group_ids as resolve_group_ids
from hf_core.algorithms.masked import masked_mean, masked_sum
from hf_core.algorithms.registry import aggregation_mode, get_aggregation_mode


def _sequence_mean(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    has_tokens = (mask != 0).any(dim=-1)
    return masked_mean(per_sequence, has_tokens)


@aggregation_mode("token-mean")
def token_mean(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Σ l·m / Σ m over every valid token of the batch."""
    return masked_mean(loss_mat, mask)


@aggregation_mode("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Mean over sequences of Σ_t l·m."""
    return _sequence_mean(masked_sum(loss_mat, mask, dim=-1), mask)


@aggregation_mode("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Mean over sequences of (Σ_t l·m / Σ_t m)."""
    return _sequence_mean(masked_mean(loss_mat, mask, dim=-1), mask)


@aggregation_mode("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Mean over sequences of Σ_t l·m / L, L = ``norm_length`` or T (Dr. GRPO).

    Keep L constant across training (e.g. the max response length): a per-batch T reintroduces
    the length bias this mode exists to remove, and a trimmed micro-batch's T differs from its
    neighbours' (the role losses pass the mini-batch's response width).  verl's mode of the
    same name divides the *sum* over sequences by L; this one follows the paper's 1/G (see the
    module docstring).
    """
    length = float(norm_length) if norm_length is not None else float(loss_mat.shape[-1])
    if length <= 0:
        raise ValueError(f"norm_length must be > 0, got {norm_length}")
    return _sequence_mean(masked_sum(loss_mat, mask, dim=-1) / length, mask)


@aggregation_mode("group-mean-token-mean")
def group_mean_token_mean(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Mean over groups of (Σ_{i∈g} Σ_t l·m / Σ_{i∈g} Σ_t m); groups without tokens skipped."""
    if group_ids is None:
        raise ValueError("'group-mean-token-mean' needs group ids: pass index= or group_size=")
    dtype = loss_mat.dtype
    onehot = group_onehot(group_ids, dtype)  # [G, B]
    token_sums = (onehot * masked_sum(loss_mat, mask, dim=-1)[None, :]).sum(dim=1)
    token_counts = (onehot * (mask != 0).sum(dim=-1).to(dtype)[None, :]).sum(dim=1)
    per_group = token_sums / token_counts.clamp_min(1)
    return masked_mean(per_group, token_counts > 0)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    index: GroupIndex | None = None,
    group_size: int | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar with the aggregation mode named ``mode``.

    ``index``/``group_size`` name the groups (only group modes use them); ``norm_length`` is
    the constant of "seq-mean-token-sum-norm".
    """
    if loss_mat.ndim != 2 or mask.shape != loss_mat.shape:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must both be [B, T]"
        )
    fn = get_aggregation_mode(mode)
    ids = None
    if index is not None or group_size is not None:
        ids = resolve_group_ids(
            loss_mat.shape[0], index=index, group_size=group_size, device=loss_mat.device
        )
    return fn(loss_mat, mask, group_ids=ids, norm_length=norm_length)
