"""Model inputs and head outputs: the batch keys core expects, computed under TP.

megatron's rotary embedding uses positions ``0..s-1`` and a plain causal mask, while rollout
batches are left-padded prompts followed by right-padded responses.  Each row is therefore
shifted left by its number of left pads (:func:`pack_left`): real tokens then sit at
positions ``0..n-1`` -- exactly their HF ``position_ids`` -- and the causal mask alone keeps
the trailing pads from influencing them.  Outputs are read back at the shifted columns.

All per-token outputs cover the response tokens, shape ``[B, response_len]``, with hf-fsdp's
alignment: ``log_probs[:, t]`` / ``entropy[:, t]`` of response token ``t`` under
``softmax(logits / temperature)`` (raw logits when ``temperature == 0``) at the position
before it; ``values[:, t]`` at that same position; ``scores`` at each row's last real token.
Log-probs and entropy are computed on the vocabulary shards (no logits gather under TP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_core.batch import Batch
from hf_core.engines.top_k import TOP_K_IDS, TOP_K_LOG_PROBS, scored_ids, split_scored


@dataclass
class PackedInputs:
    """A micro-batch ready for the model: ids shifted left, and where to read outputs."""

    input_ids: torch.Tensor  # [B, S]
    position_ids: torch.Tensor  # [B, S], 0..S-1
    shift: torch.Tensor  # [B] left pads removed per row
    lengths: torch.Tensor  # [B] real tokens per row
    response_index: torch.Tensor | None  # [B, R] column predicting response token t
    responses: torch.Tensor | None  # [B, R], or [B, R, 1 + k] with a teacher's top-k ids
    rows: int  # real rows (the rest pads a pipeline micro-batch to full size)

    def to(self, device: torch.device) -> PackedInputs:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PackedInputs(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.shift.to(device),
            self.lengths.to(device),
            move(self.response_index),
            move(self.responses),
            self.rows,
        )


def pack_left(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shift each row left past its left padding; returns ``(ids, shift, lengths)``.

    Raises ``ValueError`` unless each row's real tokens are contiguous (left padding, tokens,
    right padding), the only row format a rollout produces.
    """
    mask = attention_mask.long()
    seq = mask.shape[1]
    shift = torch.where(mask.any(-1), mask.argmax(-1), torch.zeros_like(mask[:, 0]))
    index = (torch.arange(seq)[None, :] + shift[:, None]).clamp(max=seq - 1)
    inside = torch.arange(seq)[None, :] < (seq - shift)[:, None]
    moved = mask.gather(1, index) * inside
    lengths = moved.sum(-1)
    expected = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    if not torch.equal(moved, expected):
        raise ValueError(
            "attention_mask rows must be left padding, contiguous tokens, then right padding"
        )
    ids = torch.where(moved.bool(), input_ids.gather(1, index), torch.full_like(input_ids, pad_id))
    return ids, shift, lengths


def pack_batch(
    batch: Batch, *, rows_to: int | None = None, pad_id: int = 0, columns_to: int | None = None
) -> PackedInputs:
    """Pack a micro-batch; ``rows_to`` repeats the last row up to a fixed micro-batch size
    (pipeline stages exchange fixed-shape activations) and ``columns_to`` pads every row on
    the right (expert-parallel ranks gather equal token counts); real tokens see neither."""
    ids, shift, lengths = pack_left(batch["input_ids"], batch["attention_mask"], pad_id)
    if "position_ids" in batch:
        pos = batch["position_ids"]
        expected = (batch["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        if not torch.equal(
            (pos * batch["attention_mask"]).long(), expected * batch["attention_mask"]
        ):
            raise ValueError("position_ids must count each row's real tokens from 0 (no packing)")
    responses = index = None
    if "responses" in batch:
        # with a teacher's top-k ids: [B, R, 1 + k], scored in the same head pass
        responses = scored_ids(batch, batch["responses"])
        seq, resp = ids.shape[1], responses.shape[1]
        cols = torch.arange(resp)[None, :] + (seq - resp - 1) - shift[:, None]
        index = cols.clamp(min=0)
    rows = ids.shape[0]
    if rows_to is not None and rows_to > rows:
        extra = rows_to - rows

        def pad_rows(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.cat([t, t[-1:].expand(extra, *t.shape[1:])])

        ids, shift, lengths = pad_rows(ids), pad_rows(shift), pad_rows(lengths)
        index, responses = pad_rows(index), pad_rows(responses)
    if columns_to is not None and columns_to > ids.shape[1]:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], columns_to - ids.shape[1]), pad_id)], 1)
    positions = torch.arange(ids.shape[1])[None, :].expand_as(ids)
    return PackedInputs(ids, positions, shift, lengths, index, responses, rows)


def _tp_all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = x.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    group: dist.ProcessGroup | None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``labels`` and entropy from this rank's vocabulary shard ``logits``.

    ``labels`` has ``logits.shape[:-1]`` (one id per position) or one more dimension ``m``
    (several ids per position: log-probs ``[..., m]``).  ``logits[..., j]`` is token
    ``vocab_start + j``; ids at or past ``vocab_size`` are padding
    and excluded.  The sums over the vocabulary are all-reduced over ``group`` with megatron's
    ``reduce_from_tensor_model_parallel_region`` (identity backward: every TP rank computes
    the same loss), so both outputs are differentiable.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if group is None or dist.get_world_size(group) == 1:
            return x
        return reduce_from_tensor_model_parallel_region(x, group=group)

    shifted, valid = _shifted_shard(logits, vocab_start, vocab_size, temperature, group)
    width = logits.shape[-1]
    exp = torch.where(valid, shifted.exp(), torch.zeros_like(shifted))
    sum_exp = reduce(exp.sum(-1))
    several = labels.dim() == logits.dim()  # [..., m] ids per position
    local = (labels if several else labels[..., None]) - vocab_start
    inside = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1))
    picked = reduce(torch.where(inside, picked, torch.zeros_like(picked)))
    log_z = sum_exp.log()
    log_probs = picked - log_z[..., None]
    if not several:
        log_probs = log_probs[..., 0]
    entropy = None
    if with_entropy:
        weighted = torch.where(valid, exp * shifted, torch.zeros_like(shifted)).sum(-1)
        entropy = log_z - reduce(weighted) / sum_exp
    return log_probs, entropy


def _shifted_shard(
    logits: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's tempered float32 logits minus the global maximum per position (padding
    ids at -inf), and which of its columns are real ids."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    ids = vocab_start + torch.arange(logits.shape[-1], device=logits.device)
    valid = ids < vocab_size
    logits = logits.masked_fill(~valid, float("-inf"))
    top = _tp_all_reduce_max(logits.max(-1).values, group)
    return logits - top[..., None], valid


@torch.no_grad()
def vocab_parallel_top_k(
    logits: torch.Tensor,
    k: int,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` likeliest ids per position over all vocabulary shards and their log-probs
    (``[..., k]`` each, likeliest first; no gradient): each shard's own top-k, gathered over
    ``group``, then the top-k of those."""
    shifted, valid = _shifted_shard(logits, vocab_start, vocab_size, temperature, group)
    sum_exp = torch.where(valid, shifted.exp(), torch.zeros_like(shifted)).sum(-1)
    values, ids = shifted.topk(min(k, shifted.shape[-1]), dim=-1)
    ids = ids + vocab_start
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sum_exp, group=group)
        size = dist.get_world_size(group)
        all_values = [torch.empty_like(values) for _ in range(size)]
        all_ids = [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(all_values, values.contiguous(), group=group)
        dist.all_gather(all_ids, ids.contiguous(), group=group)
        values, where = torch.cat(all_values, dim=-1).topk(k, dim=-1)
        ids = torch.cat(all_ids, dim=-1).gather(-1, where)
    return values - sum_exp.log()[..., None], ids


def gather_columns(per_position: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``per_position[b, index[b, t], ...]`` for a ``[B, S, ...]`` tensor."""
    extra = per_position.shape[2:]
    idx = index.reshape(*index.shape, *([1] * len(extra))).expand(*index.shape, *extra)
    return per_position.gather(1, idx)


def lm_outputs(
    logits: torch.Tensor,
    packed: PackedInputs,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    group: dist.ProcessGroup | None,
    with_entropy: bool = True,
    top_k: int = 0,
) -> dict[str, torch.Tensor]:
    """``log_probs`` / ``entropy`` ``[B, R]`` from ``[B, S, V/tp]`` logits; the log-probs at
    a teacher's top-k ids when the packed responses carry them, and (``top_k``) the model's
    own top-k ids and log-probs (:mod:`hf_core.engines.top_k`)."""
    assert packed.response_index is not None and packed.responses is not None
    picked = gather_columns(logits, packed.response_index)
    log_probs, entropy = vocab_parallel_log_probs(
        picked,
        packed.responses,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        temperature=temperature,
        group=group,
        with_entropy=with_entropy,
    )
    out = split_scored(log_probs)
    if entropy is not None:
        out["entropy"] = entropy
    if top_k:
        out[TOP_K_LOG_PROBS], out[TOP_K_IDS] = vocab_parallel_top_k(
            picked,
            top_k,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            temperature=temperature,
            group=group,
        )
    return out


def value_outputs(head_out: torch.Tensor, packed: PackedInputs) -> dict[str, torch.Tensor]:
    """``values`` ``[B, R]`` from a ``[B, S, 1]`` value head."""
    assert packed.response_index is not None
    return {"values": gather_columns(head_out[..., 0].float(), packed.response_index)}


def score_outputs(head_out: torch.Tensor, packed: PackedInputs) -> dict[str, torch.Tensor]:
    """``scores`` ``[B]`` at each row's last real token."""
    last = (packed.lengths - 1).clamp(min=0)
    return {"scores": head_out[..., 0].float().gather(1, last[:, None])[:, 0]}
