"""Token-budget micro-batches with the padding removed: what training engines run forwards on.

A rollout batch is rectangular: prompts left-padded to the longest prompt, responses
right-padded to ``max_new_tokens``.  Cutting it into fixed-size micro-batches wastes most of
a forward on padding when lengths vary, and small micro-batches waste per-call overhead.
:func:`split_micro_batches` instead groups samples of similar length (sorted by their real
token count) into micro-batches of at most ``max_tokens`` *padded* tokens, and
:func:`trim_padding` cuts each micro-batch down to its own longest prompt and response, so
columns that are padding for every row are never computed.

Removed columns are padding for every row of the micro-batch (mask 0), so masked sums, the
token counts a loss scales by, and every real token's output are unchanged; the outputs come
back in the original order and width through :func:`restore_outputs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY
from hf_core.renamed import PLAN_MEANS_PLACEMENT, renamed_attributes

if TYPE_CHECKING:
    from hf_core.batch import Batch

SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", ROUTED_EXPERTS_KEY)
"""Tensors laid out over prompt + response columns."""
PROMPT_ONLY_KEYS = ("prompts",)
"""Tensors laid out over prompt columns only."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch and where its rows came from (``rows`` index the full batch)."""

    batch: Batch
    rows: torch.Tensor


def sample_lengths(batch: Batch) -> torch.Tensor:
    """Real tokens per row (prompt + response), from the attention mask."""
    return batch["attention_mask"].sum(-1)


def split_micro_batches(
    batch: Batch,
    max_tokens: int | None,
    max_samples: int | None = None,
    prompt_groups: torch.Tensor | None = None,
) -> list[MicroBatch]:
    """Split ``batch`` into length-grouped micro-batches, each trimmed of shared padding.

    A micro-batch holds at most ``max_samples`` rows and, once trimmed, at most
    ``max_tokens`` tokens (rows x its longest row); a row longer than the budget goes alone.
    ``max_tokens=None`` groups by ``max_samples`` alone (in the original order, as fixed-size
    micro-batches did).  ``prompt_groups`` (a group index per row, rows sharing a prompt
    share one) keeps each group in one micro-batch where it fits, so a forward can compute
    its prompt once (:mod:`hf_core.engines.shared_prefix`).  Deterministic: the same batch
    gives the same micro-batches.
    """
    size = len(batch)
    if size == 0:
        return []
    cap = max_samples or size
    if max_tokens is None:
        order = torch.arange(size)
        groups = [order[i : i + cap] for i in range(0, size, cap)]
    elif prompt_groups is not None and int(prompt_groups.max()) + 1 < size:
        groups = _pack_prompt_groups(sample_lengths(batch), prompt_groups, max_tokens, cap)
    else:
        groups = _pack_by_length(sample_lengths(batch), max_tokens, cap)
    return [MicroBatch(trim_padding(batch.index(rows)), rows) for rows in groups]


def _pack_prompt_groups(
    lengths: torch.Tensor, prompt_groups: torch.Tensor, max_tokens: int, cap: int
) -> list[torch.Tensor]:
    """Whole prompt groups, ordered by their longest row, packed under the budget; a group
    too large for one micro-batch is split by length on its own."""
    members = [
        torch.nonzero(prompt_groups == g).flatten() for g in range(int(prompt_groups.max()) + 1)
    ]
    members = [m for m in members if len(m)]
    members.sort(key=lambda rows: int(lengths[rows].max()))  # stable: ties keep group order
    out: list[torch.Tensor] = []
    current: list[torch.Tensor] = []
    count = 0
    for rows in members:
        longest = int(lengths[rows].max())  # sorted: the newest group is the longest
        if current and (count + len(rows) > cap or (count + len(rows)) * longest > max_tokens):
            out.append(torch.cat(current))
            current, count = [], 0
        if len(rows) <= cap and len(rows) * longest <= max_tokens:
            current.append(rows)
            count += len(rows)
        else:
            out.extend(rows[part] for part in _pack_by_length(lengths[rows], max_tokens, cap))
    if current:
        out.append(torch.cat(current))
    return out


def _pack_by_length(lengths: torch.Tensor, max_tokens: int, cap: int) -> list[torch.Tensor]:
    order = torch.sort(lengths, stable=True).indices
    groups: list[torch.Tensor] = []
    start = 0
    for end in range(1, len(order) + 1):
        longest = int(lengths[order[end - 1]])  # sorted: the newest row is the longest
        over_budget = (end - start) * longest > max_tokens and end - start > 1
        if end - start > cap or over_budget:
            groups.append(order[start : end - 1])
            start = end - 1
    groups.append(order[start:])
    return groups


def trim_padding(batch: Batch) -> Batch:
    """The micro-batch without the prompt columns every row pads (left) and the response
    columns every row pads (right).  Needs ``responses`` and ``attention_mask``; batches
    without responses (prompt-only) are returned unchanged."""
    if "responses" not in batch or len(batch) == 0:
        return batch
    response_len = int(batch["responses"].shape[1])
    mask = batch["attention_mask"]
    prompt_len = int(mask.shape[1]) - response_len
    prompt_mask = mask[:, :prompt_len]
    response_mask = mask[:, prompt_len:]
    left = int((prompt_mask.cumsum(-1) == 0).sum(-1).min()) if prompt_len else 0
    keep = int(response_mask.sum(-1).max())
    if left == 0 and keep == response_len:
        return batch
    out = batch.select(*batch.keys())
    for key, value in batch.tensors.items():
        if value.ndim < 2:
            continue
        if key in SEQUENCE_KEYS:
            out[key] = value[:, left : prompt_len + keep]
        elif key in PROMPT_ONLY_KEYS:
            out[key] = value[:, left:]
        elif value.shape[1] == response_len:
            out[key] = value[:, :keep]
    out.meta.update(batch.meta)
    return out


def restore_outputs(
    outputs: list[dict[str, torch.Tensor]],
    micro: list[MicroBatch],
    size: int,
    width: int,
    response_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-micro-batch outputs back in the batch's row order, per-token ones ``[B, width]``.

    With ``response_mask``, per-token outputs are 0 wherever it is 0, so padding positions
    read the same however the batch was cut into micro-batches.
    """
    if not outputs:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for key in outputs[0]:
        first = outputs[0][key]
        shape = (size, width, *first.shape[2:]) if first.ndim >= 2 else (size, *first.shape[1:])
        full = first.new_zeros(shape)
        for out, part in zip(outputs, micro, strict=True):
            value = out[key]
            if value.ndim >= 2:
                full[part.rows, : value.shape[1]] = value
            else:
                full[part.rows] = value
        if response_mask is not None and full.ndim >= 2:
            full = full * response_mask.to(full.dtype).reshape(size, width, *[1] * (full.ndim - 2))
        merged[key] = full
    return merged


if not TYPE_CHECKING:  # type checkers keep flagging unknown names
    __getattr__ = renamed_attributes(
        __name__, {"plan_micro_batches": "split_micro_batches"}, PLAN_MEANS_PLACEMENT
    )
