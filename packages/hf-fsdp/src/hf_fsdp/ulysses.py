"""Ulysses sequence parallelism: a group of ranks splits each micro-batch's tokens.

Every rank of a sequence-parallel (SP) group receives the same data chunk.  A micro-batch is
laid out as rows of ``L`` tokens (``L`` a multiple of the group size ``S``) and each rank runs
the model on its own ``L / S`` columns: embeddings, MLPs, norms and the head are per token,
so they need nothing from the other ranks.  Attention does: before it, an all-to-all trades
the sequence split for a head split (each rank then holds every token of ``H / S`` heads),
attention runs over whole samples, and a second all-to-all trades back (DeepSpeed-Ulysses,
arXiv 2309.14509).  Activation memory per rank falls by ``S``; the weights stay FSDP-sharded
over all ranks as without SP.

Two arrangements (:func:`lay_out`): packed, the micro-batch's real tokens back to back in one row
(attention runs per sample, each a causal block: no mask, no padding beyond rounding ``L``
up); or padded rows, each sample's tokens left-aligned in its own row (causal attention
without a mask is exact for the real tokens, which come first).

Gradients: each rank's outputs cover its own columns and are gathered (autograd-aware) so
every rank computes the same loss over the whole micro-batch; the gather's backward sums the
ranks' gradients, so the ``S`` ranks of a group together hold ``S`` times the gradient of
their chunk and FSDP's average over all ``D x S`` ranks equals the data-parallel average over
``D`` chunks (the loss is scaled by ``D``, the number of chunks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hf_core.engines.sequence_packing import pack_sequences
from hf_core.errors import EngineConfigError

ATTENTION = "hf_ulysses"
"""The attention implementation name a sequence-parallel model runs under (registered with
transformers' ``AttentionInterface``; with no mask function of its own, transformers builds
no mask for it: the segments below say where samples start)."""


@dataclass(frozen=True)
class SequenceShards:
    """A micro-batch laid out for a sequence-parallel group of ``size`` ranks."""

    input_ids: torch.Tensor
    """``[rows, L]``, ``L`` a multiple of the group size."""
    position_ids: torch.Tensor
    """``[rows, L]``: each token's position in its own sample."""
    targets: torch.Tensor
    """``[rows, L]``: the token each position predicts (the next one in its row)."""
    predict_from: torch.Tensor
    """``[B, R]`` index into the ``rows * L`` positions: the one predicting response token
    ``t`` of sample ``b`` (a padding column reads a real position; the mask drops it)."""
    last_token: torch.Tensor
    """``[B]`` index into the ``rows * L`` positions: each sample's last real token."""
    segments: tuple[tuple[int, int], ...]
    """Column ranges attention stays inside (the same in every row)."""
    padding: int
    """Padding tokens the arrangement computes."""

    def local(self, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s columns of a ``[rows, L, ...]`` tensor."""
        width = tensor.shape[1] // size
        return tensor[:, rank * width : (rank + 1) * width]


def lay_out(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_width: int,
    size: int,
    packed: bool,
) -> SequenceShards:
    """The micro-batch as :class:`SequenceShards` for ``size`` ranks: one packed row, or one
    left-aligned row per sample.  Real tokens must be contiguous in each row (left-padded
    prompt, right-padded response), the rows rollouts produce."""
    mask = attention_mask.bool().cpu()
    lengths = mask.sum(-1)
    if packed:
        seq = pack_sequences(input_ids, mask, position_ids, response_width)
        total = int(lengths.sum())
        width = -(-total // size) * size
        pad = width - total
        ids = F.pad(seq.input_ids, (0, pad))
        positions = torch.cat([seq.position_ids, torch.arange(pad)[None]], dim=1)
        ends = lengths.cumsum(0)
        starts = ends - lengths
        bounds = [(int(s), int(e)) for s, e in zip(starts, ends, strict=True) if e > s]
        segments = tuple(bounds + ([(total, width)] if pad else []))
        return SequenceShards(
            input_ids=ids,
            position_ids=positions,
            targets=_next_tokens(ids),
            predict_from=seq.predict_from,
            last_token=ends - 1,
            segments=segments,
            padding=pad,
        )
    rows = mask.shape[0]
    width = -(-int(lengths.max()) // size) * size
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real tokens first
    ids = input_ids.cpu().gather(1, order) * mask.gather(1, order)
    ids = F.pad(ids, (0, width - ids.shape[1])) if width > ids.shape[1] else ids[:, :width]
    positions = torch.arange(width).expand(rows, width).contiguous()
    index = (mask.long().cumsum(-1) - 1).clamp(min=0)
    columns = mask.shape[1]
    offsets = (torch.arange(rows) * width)[:, None]
    predict_from = offsets + index[:, columns - response_width - 1 : columns - 1]
    return SequenceShards(
        input_ids=ids,
        position_ids=positions,
        targets=_next_tokens(ids),
        predict_from=predict_from,
        last_token=offsets[:, 0] + lengths - 1,
        segments=((0, width),),
        padding=int(rows * width - lengths.sum()),
    )


def lay_out_like(
    values: torch.Tensor,
    attention_mask: torch.Tensor,
    size: int,
    packed: bool,
    fill: int | float | bool,
) -> torch.Tensor:
    """A ``[rows, columns, ...]`` per-token tensor of the micro-batch (laid out like its
    ``input_ids``) arranged as :func:`lay_out` arranges ``input_ids`` for ``size`` ranks:
    packed, the real tokens in row order then ``fill`` up to the rounded width (one row);
    else each row's real tokens first (the same stable order) then ``fill``, padded or cut
    to the longest sample rounded up.  ``[rows', L, ...]`` on the CPU; take a rank's columns
    with :meth:`SequenceShards.local`.  The routing a replayed forward runs
    (:mod:`hf_fsdp.moe_routing`) and its real-token mask (``attention_mask`` itself, with
    ``fill=False``) are laid out this way."""
    mask = attention_mask.bool().cpu()
    values = values.cpu()
    lengths = mask.sum(-1)
    if packed:
        real = values[mask]  # pack_sequences' order: the real tokens, row by row
        total = int(lengths.sum())
        width = -(-total // size) * size
        out = real.new_full((width, *values.shape[2:]), fill)
        out[:total] = real
        return out[None]
    rows, columns = mask.shape
    width = -(-int(lengths.max()) // size) * size
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # as lay_out's
    index = order.reshape(rows, columns, *([1] * (values.dim() - 2))).expand_as(values)
    arranged = values.gather(1, index)
    real = mask.gather(1, order).reshape(index.shape[:2] + (1,) * (values.dim() - 2))
    arranged = arranged.masked_fill(~real, fill)
    out = arranged.new_full((rows, width, *values.shape[2:]), fill)
    kept = min(width, columns)
    out[:, :kept] = arranged[:, :kept]
    return out


def _next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """Each position's next token in its row (0 after the last)."""
    return F.pad(ids[:, 1:], (0, 1))


# ------------------------------------------------------------------ collectives
def _all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup
) -> torch.Tensor:
    size = dist.get_world_size(group)
    inputs = [part.contiguous() for part in x.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Scatter ``scatter_dim`` over the group and gather ``gather_dim``; the backward is the
    inverse exchange."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _GatherColumns(torch.autograd.Function):
    """Every rank's columns, concatenated; the backward sums the ranks' gradients (each
    computed the same loss from the gathered whole) and keeps this rank's columns."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=1)[rank], None


def gather_columns(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[rows, L / S, ...]`` per rank to ``[rows, L, ...]`` on every rank (with autograd)."""
    return _GatherColumns.apply(x, group)  # type: ignore[no-any-return]


class _AllReduceSum(torch.autograd.Function):
    """The group's sum on every rank; the backward sums the ranks' gradients (each rank
    computed the same loss from the sum), the convention of :class:`_GatherColumns`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.group = group
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``x`` over ``group`` on every rank (with autograd): a sum over the whole
    micro-batch's tokens from each rank's sum over its own columns."""
    return _AllReduceSum.apply(x, group)  # type: ignore[no-any-return]


# ------------------------------------------------------------------ attention
@dataclass(frozen=True)
class _Segments:
    group: dist.ProcessGroup
    segments: tuple[tuple[int, int], ...]


_SEGMENTS: dict[int, _Segments] = {}
"""The current micro-batch's sample segments per model config (by id): set before each forward and
kept until the next, so a backward that recomputes the forward (gradient checkpointing)
sees the same one."""


def set_segments(
    model: nn.Module, group: dist.ProcessGroup, segments: Sequence[tuple[int, int]]
) -> None:
    """The group and sample segments the model's next forward (and its recomputation) uses."""
    _SEGMENTS[id(model.config)] = _Segments(group, tuple(segments))


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``[B, heads, L / S, D]`` per rank in, ``[B, L / S,
    heads, D]`` out.  Attention itself runs on every token of ``heads / S`` heads, causal
    inside each segment."""
    current = _SEGMENTS.get(id(module.config))
    if current is None:
        raise RuntimeError(
            f"{type(module).__name__}: sequence-parallel attention without sample segments; "
            "the engine sets them before each forward (hf_fsdp.ulysses.set_segments)"
        )
    size = dist.get_world_size(current.group)
    if key.shape[1] % size:  # fewer key/value heads than ranks: give each query head its own
        repeat = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    q, k, v = (_AllToAll.apply(t, 1, 2, current.group) for t in (query, key, value))
    gqa = k.shape[1] != q.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            q[:, :, s:e],
            k[:, :, s:e],
            v[:, :, s:e],
            dropout_p=dropout,
            scale=scaling,
            is_causal=True,
            enable_gqa=gqa,
        )
        for s, e in current.segments
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    out = _AllToAll.apply(out, 2, 1, current.group)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


def sequence_parallel_group(size: int) -> dist.ProcessGroup | None:
    """This rank's group of ``size`` consecutive ranks (``None`` for ``size == 1``).
    Collective: every rank creates every group, as torch.distributed requires."""
    if size == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise EngineConfigError(
            f"sequence_parallel_size={size} must divide the {world} ranks of the engine's "
            "group (parallel.sp in the recipe)"
        )
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine


def enable(model: nn.Module, size: int) -> None:
    """Make ``model`` run its attention sequence-parallel over groups of ``size`` ranks;
    raises :class:`EngineConfigError` where its heads cannot be split that way."""
    config = model.config
    if getattr(config, "vision_config", None) is not None:
        raise EngineConfigError(
            f"sequence_parallel_size={size}: {type(model).__name__} is a vision-language "
            "model, whose vision tower runs on whole images; use parallel.sp: 1"
        )
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % size:
        raise EngineConfigError(
            f"sequence_parallel_size={size}: the model's {heads} attention heads must split "
            f"evenly over the ranks (parallel.sp must divide {heads})"
        )
    if kv_heads % size and size % kv_heads:
        raise EngineConfigError(
            f"sequence_parallel_size={size}: the model's {kv_heads} key/value heads must "
            f"split over the ranks or divide them"
        )
    _register()
    config._attn_implementation = ATTENTION
