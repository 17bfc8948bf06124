"""Masked reductions over response tokens.

Per-token tensors are [B, T] with a ``response_mask`` (1 for real tokens, 0 for padding).  Every
reduction here *selects* valid entries with :func:`torch.where` instead of multiplying by the
mask, so a NaN or inf sitting in a padded slot (e.g. a log-prob of a pad token) cannot leak into
the result: ``nan * 0`` is ``nan``, ``where(mask, nan, 0)`` is ``0``.

An empty selection reduces to 0 for sums and means (an all-padding micro-batch contributes no
loss and no gradient) and is an error for the unbiased variance, which needs two samples.
"""

from __future__ import annotations

import torch

_TINY = 1e-8


def _check(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.shape != values.shape:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but values have shape {tuple(values.shape)}"
        )
    return mask


def _weights(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    dtype = values.dtype if values.is_floating_point() else torch.get_default_dtype()
    return mask.to(dtype)


def masked_sum(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | tuple[int, ...] | None = None,
    keepdim: bool = False,
) -> torch.Tensor:
    """Σ values·mask over ``dim`` (all dims when ``None``), ignoring whatever padding holds."""
    _check(values, mask)
    weights = _weights(values, mask)
    picked = torch.where(mask != 0, values * weights, torch.zeros((), dtype=weights.dtype))
    if dim is None:
        return picked.sum()
    return picked.sum(dim=dim, keepdim=keepdim)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | tuple[int, ...] | None = None,
    keepdim: bool = False,
) -> torch.Tensor:
    """Σ values·mask / Σ mask over ``dim``; 0 where the mask selects nothing."""
    total = masked_sum(values, mask, dim=dim, keepdim=keepdim)
    weights = _weights(values, mask)
    count = weights.sum() if dim is None else weights.sum(dim=dim, keepdim=keepdim)
    return total / count.clamp_min(_TINY)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected entries (all dims together).

    ``unbiased`` applies Bessel's n/(n−1) correction as ``torch.var`` does, which needs at least
    two selected entries; fewer is a :class:`ValueError` rather than a silent inf/NaN.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = int((mask != 0).sum())
        if count < 2:
            raise ValueError(
                f"unbiased masked variance needs at least 2 valid entries, got {count}"
            )
        var = var * (count / (count - 1))
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(values − mean) / sqrt(var + eps) over the valid entries; padding comes out as 0.

    Statistics are taken over the whole masked tensor (batch whitening, as PPO implementations
    do for advantages).  ``shift_mean=False`` rescales but keeps the mean, as some reward
    normalisations want.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask != 0, whitened, torch.zeros((), dtype=whitened.dtype))


def check_token_shapes(response_mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Every per-token input must be ``[B, T]``, the response mask's shape (names the culprit)."""
    if response_mask.ndim != 2:
        raise ValueError(f"response_mask must be [B, T], got {tuple(response_mask.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != response_mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, "
                f"expected response_mask's {tuple(response_mask.shape)}"
            )
