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

from dataclasses import dataclass, field

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


def load_balancing_loss(
    logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """One MoE layer's load-balancing loss (Switch Transformer, normalised as megatron-core
    does): ``num_experts * sum_e f_e * P_e`` over the real tokens, where ``f_e`` is the share
    of the layer's top-k slots routed to expert ``e`` (the ``[tokens, k]`` ``ids`` the layer
    ran; no gradient) and ``P_e`` the mean router probability of ``e`` (softmax of the
    ``[tokens, experts]`` ``logits``; the gradient flows here).  1.0 when the load and the
    probabilities are uniform, ``num_experts`` at worst.  ``real``: ``[tokens]`` bool, False
    for padding.  transformers' ``load_balancing_loss_func`` pools every layer's tokens before
    the product and counts k slots per token (k at balance), so it differs by that factor and
    the pooling.  0 without real tokens."""
    keep = real.to(logits.device).bool()
    count = int(keep.sum())
    if count == 0:
        return logits.sum() * 0.0
    probs = torch.softmax(logits[keep].float(), dim=-1)
    chosen = ids[keep].reshape(-1).long()
    slots = torch.bincount(chosen, minlength=num_experts)[:num_experts].to(probs.dtype)
    share = slots / chosen.numel()
    return num_experts * (share * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """One MoE layer's router z-loss (ST-MoE): the mean over real tokens (``real``,
    ``[tokens]`` bool) of ``logsumexp(logits)^2``; keeps the router's logits small.  0 without
    real tokens."""
    keep = real.to(logits.device).bool()
    if int(keep.sum()) == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits[keep].float(), dim=-1).square().mean()


def check_routed_experts(
    routed: torch.Tensor, experts_per_layer: list[int], top_k_per_layer: list[int]
) -> None:
    """Raise :class:`~hf_core.errors.DataError` unless ``routed`` (the batch's
    ``[rows, columns, layers, k]`` ids) fits the model whose MoE layers have
    ``experts_per_layer`` experts and route to ``top_k_per_layer`` each: its layer count and k,
    and every id other than the unrecorded marker in ``[0, experts)``.  Called before a
    forward, so a batch of another model (or a corrupted one) fails naming the key, the value,
    the layer and the model's expert count rather than indexing out of range inside it."""
    from hf_core.errors import DataError

    key = ROUTED_EXPERTS_KEY
    layers = len(experts_per_layer)
    if routed.dim() != 4:
        raise DataError(
            f"batch key {key!r} has shape {tuple(routed.shape)}; it must be [rows, columns, "
            f"moe layers, top_k] = [.., .., {layers}, ..]"
        )
    if routed.shape[2] != layers:
        raise DataError(
            f"batch key {key!r}: the routed experts cover {routed.shape[2]} MoE layers, the "
            f"model has {layers}: "
            f"were the rollouts generated by another model?"
        )
    if routed.dtype not in (torch.uint8, torch.int16, torch.int32, torch.int64):
        raise DataError(f"batch key {key!r} holds {routed.dtype}; expert ids are integers")
    marker = unrecorded(routed.dtype)
    for layer, (experts, k) in enumerate(zip(experts_per_layer, top_k_per_layer, strict=True)):
        if routed.shape[3] != k:
            raise DataError(
                f"batch key {key!r} records {routed.shape[3]} experts per token, MoE layer "
                f"{layer} of the model routes to top_k={k}: were the rollouts generated by "
                f"another model?"
            )
        ids = routed[:, :, layer]
        bad = (ids != marker) & ((ids.long() >= experts) | (ids.long() < 0))
        if bool(bad.any()):
            row, column, slot = (int(i) for i in bad.nonzero()[0])
            value = int(ids[row, column, slot])
            raise DataError(
                f"batch key {key!r}: expert id {value} at MoE layer {layer} (row {row}, column "
                f"{column}), but that layer of the model has {experts} experts (ids 0..."
                f"{experts - 1}; {marker} marks an unrecorded position in {routed.dtype}): "
                f"were the rollouts generated by another model?"
            )


def keep_first_routing(
    known: torch.Tensor | None, fed: torch.Tensor, owner: str
) -> torch.Tensor | None:
    """One sample's ``[positions, moe layers, k]`` experts from position 0 on, after a forward
    that fed its positions ``0, 1, ...`` again (``fed``; positions it did not feed hold the
    unrecorded marker): positions already in ``known`` keep their experts, positions beyond
    are added up to the first unrecorded one.  ``owner`` names the sample in errors.

    Why the first forward's experts: the token after position ``p`` was sampled from the
    output at ``p`` of the forward that first fed ``p``, and its behaviour log-prob is that
    forward's; replaying those experts at ``p`` scores the token through the sub-network that
    sampled it, which is what routing replay is for.  A later forward that feeds the prefix
    again (a chunked stream's next chunk, the re-prefill after a weight update, an agent's next
    turn) samples only tokens after it: its routing of the prefix reaches them through
    attention, not through the sampled position's own experts.  With one routing per position
    no choice reproduces both; with unchanged weights the two agree up to near ties of the
    router's logits.  Keeping the first record also means a token's recorded experts never
    change once its log-prob is recorded.
    """
    start = 0 if known is None else int(known.shape[0])
    fresh = fed[start:]
    if not len(fresh):
        return known
    valid = recorded_mask(fresh).flatten(1).all(dim=1)
    cut = int(valid.long().cumprod(0).sum())  # up to the first unrecorded position
    if not cut:
        return known
    fresh = fresh[:cut].to("cpu")
    if known is None:
        return fresh.clone()
    if known.shape[1:] != fresh.shape[1:] or known.dtype != fresh.dtype:
        raise ValueError(
            f"{owner}: routing of shape {tuple(fresh.shape[1:])} ({fresh.dtype}) after "
            f"{tuple(known.shape[1:])} ({known.dtype}): another model?"
        )
    return torch.cat([known, fresh])


def routing_batch(
    samples: list[tuple[torch.Tensor | None, int, int]], prompt_width: int, response_width: int
) -> torch.Tensor | None:
    """Per-sample experts (:func:`keep_first_routing`'s, with each sample's prompt length and
    response length) in a batch's layout: ``[rows, prompt_width + response_width, layers, k]``,
    prompts left-padded and responses right-padded as in ``input_ids``, the unrecorded marker
    where nothing was fed.  None when no sample has any."""
    first = next((routed for routed, _, _ in samples if routed is not None), None)
    if first is None:
        return None
    shape = (len(samples), prompt_width + response_width, *first.shape[1:])
    out = torch.full(shape, unrecorded(first.dtype), dtype=first.dtype)
    for row, (routed, prompt, response) in enumerate(samples):
        if routed is None:
            continue
        fed = routed[: prompt + response]
        out[row, prompt_width - prompt : prompt_width] = fed[:prompt]
        tail = fed[prompt:]
        out[row, prompt_width : prompt_width + len(tail)] = tail
    return out


@dataclass
class RoutingStats:
    """What replayed forwards saw, summed over micro-batches (each backend's replay fills it):
    how often the training router's own top-k set equals the recorded one, and each layer's
    expert load."""

    matching: int = 0
    compared: int = 0
    load_ratios: list[float] = field(default_factory=list)
    """Per layer and forward: the busiest expert's tokens over the mean per expert."""

    def metrics(self) -> dict[str, float]:
        if not self.compared:
            return {}
        ratios = self.load_ratios
        return {
            "moe/router_agreement": self.matching / self.compared,
            "moe/expert_load_max_over_mean": sum(ratios) / len(ratios),
            "moe/expert_load_max_over_mean_max": max(ratios),
        }
