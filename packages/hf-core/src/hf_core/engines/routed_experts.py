"""Routing replay for mixture-of-experts models: the rollout's expert choices, carried in
the batch and used again by every training forward of the same tokens.

Why: an MoE layer sends each token to the top-k experts of its router.  The rollout engine
and the trainer compute the router's logits with different kernels, so a near tie flips a
token's top-k set and the trainer scores the token with other experts than the ones that
sampled it: the old and new log-probs then come from different sub-networks, the
importance ratios are noise, and runs collapse.  Routing replay (R3) records each token's
top-k expert ids per MoE layer in the rollout and makes the training forward (old log-prob
recompute, reference, update) route to those experts.  The gate weights are still the
training router's own softmax over the recorded experts, so the router keeps its gradient.

The batch carries the ids compactly under :data:`ROUTED_EXPERTS_KEY`: one
``[rows, prompt + response columns, moe layers, top_k]`` tensor laid out like
``input_ids``, in the smallest integer dtype that holds the expert ids
(:func:`routing_dtype`).  Positions the rollout never fed through the model (padding, a
response's last token) hold :func:`unrecorded` and route as the trainer's router chooses.

This module is backend-neutral tensor arithmetic; each backend hooks its own router modules
(e.g. ``hf_fsdp.moe_routing`` for transformers models).
"""

from __future__ import annotations

import torch

ROUTED_EXPERTS_KEY = "routed_experts"
"""Batch key of the rollout's expert ids: ``[rows, columns, moe_layers, top_k]``."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """uint8 while the ids and the unrecorded marker fit in a byte (up to 255 experts), int16
    beyond: 1 or 2 bytes per token, layer and chosen expert."""
    return torch.uint8 if num_experts < 255 else torch.int16


def unrecorded(dtype: torch.dtype) -> int:
    """The marker of a position without recorded experts: 255 in uint8, -1 in int16."""
    return 255 if dtype == torch.uint8 else -1


def recorded_mask(routed: torch.Tensor) -> torch.Tensor:
    """True where ``routed`` holds a recorded expert id."""
    return routed != unrecorded(routed.dtype)


def replayed_gates(
    logits: torch.Tensor, recorded: torch.Tensor, own: torch.Tensor, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k ``(indices, gate weights)`` a replayed router layer uses.

    ``logits``: the training router's ``[tokens, experts]`` logits; ``recorded``: the
    rollout's ``[tokens, k]`` ids (rows without a record take ``own``, the trainer's own
    top-k); ``normalize``: whether the router renormalises its top-k probabilities (Mixtral,
    Qwen3-MoE with ``norm_topk_prob``).  The weights are the softmax over all experts at the
    chosen ids, renormalised when the router does, so gradients reach the router's logits.
    """
    valid = recorded_mask(recorded).all(dim=-1, keepdim=True)
    indices = torch.where(valid, recorded.to(own.dtype), own)
    probs = torch.softmax(logits.float(), dim=-1)
    gates = probs.gather(-1, indices)
    if normalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return indices, gates


def pad_columns(routed: torch.Tensor, columns: int) -> torch.Tensor:
    """``routed`` (``[rows, cols, layers, k]``) padded on the right with the unrecorded
    marker to ``columns`` columns."""
    missing = columns - routed.shape[1]
    if missing <= 0:
        return routed[:, :columns]
    pad = routed.new_full((routed.shape[0], missing, *routed.shape[2:]), unrecorded(routed.dtype))
    return torch.cat([routed, pad], dim=1)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token (leading dims), whether two ``[..., k]`` expert-id tensors hold the same set."""
    return (a.sort(dim=-1).values == b.to(a.dtype).sort(dim=-1).values).all(dim=-1)


def expert_load(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert: ``[experts]`` counts from ``[tokens, k]`` ids."""
    return torch.bincount(indices.reshape(-1).long(), minlength=num_experts)[:num_experts]
