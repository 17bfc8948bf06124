"""Shared-prefix packing: a group's prompt computed once in a training forward, not n times.

GRPO-style batches hold each prompt ``n`` times, once per sampled response.  A plain forward
runs every row's prompt through the model again; at short responses that is a large share
of the update (with 14-token prompts and 32-token responses about a quarter of the tokens
are a repeated prompt).  Packing lays a group out as one sequence,
``[prompt, response_1, ..., response_n]``, with each response attending to the prompt and to
itself only (a block mask) and keeping the positions it had in its own row, so every
response token sees exactly the context it saw unpacked: the outputs agree to rounding.
A response's last token is left out: it is an input to no prediction.

:func:`pack_shared_prefixes` decides and builds; the head then reads the hidden state that
predicts response token ``t`` of row ``b`` at ``predict_from[b, t]`` of the flattened packed
positions (the prompt's last token for ``t = 0``).  Both functions work on the host whatever
device their inputs are on (a few small integer tensors, built in Python loops that would be
hundreds of tiny kernel launches on a GPU); the caller moves the result to its device.
It packs only where the dense work saved outweighs the larger attention of a longer sequence
and the block mask stays small, so long responses keep plain rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_MASK_ELEMENTS = 32 * 2**20
"""Largest block mask (groups x length x length booleans) packing may build."""


@dataclass(frozen=True)
class PackedPrefixes:
    """A micro-batch laid out one row per prompt group (``G`` groups, ``L`` positions)."""

    input_ids: torch.Tensor
    """``[G, L]``; positions after a group's end hold 0."""
    position_ids: torch.Tensor
    """``[G, L]``: each token's position in its own (unpacked) row."""
    attention_mask: torch.Tensor
    """``[G, 1, L, L]`` booleans, True where query position may attend to key position."""
    predict_from: torch.Tensor
    """``[B, R]`` index into the ``G * L`` flattened positions: the hidden state whose output
    predicts response token ``t`` of row ``b`` (padding tokens read a real position too, so
    their outputs stay finite)."""
    padding: int = 0
    """Positions after a group's end (computed, read by nothing)."""


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int
) -> torch.Tensor:
    """Group index of each row (numbered in order of first appearance): rows whose prompt
    columns hold the same real tokens and padding share one."""
    prompt_width = input_ids.shape[1] - response_width
    return _prompt_groups(input_ids[:, :prompt_width].cpu(), attention_mask[:, :prompt_width].cpu())


def _prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    key = torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    # number groups in order of first appearance, so packing is deterministic in row order
    first = torch.full((int(inverse.max()) + 1,), len(inverse), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(len(inverse)), reduce="amin")
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(len(first))
    return rank[inverse]


def _right_padded(mask: torch.Tensor) -> bool:
    """Every row's ones come first (no holes): the row format packing assumes for responses."""
    lengths = mask.sum(-1, keepdim=True)
    columns = torch.arange(mask.shape[1])
    return bool(torch.equal(mask.bool(), columns < lengths))


def _left_padded(mask: torch.Tensor) -> bool:
    return _right_padded(mask.flip(-1))


def forward_cost(rows: int, length: int, hidden_size: int) -> float:
    """A forward's cost over ``rows`` rows of ``length`` positions, in dense-work units per
    token: ~24 h^2 multiply-adds a layer per token, plus ~4 h per query-key pair that a masked
    kernel visits (all ``length`` keys of each query)."""
    pair_per_token = 4.0 / (24.0 * hidden_size)
    return rows * length * (1 + pair_per_token * length)


def packing_pays(
    rows: int,
    row_length: int,
    packed_lengths: list[int],
    hidden_size: int,
) -> bool:
    """Whether packed groups cost less than the plain rows: dense work per token (~24 h^2
    multiply-adds a layer) against attention per query-key pair (~4 h, the block mask makes
    the kernel visit every pair of the longer packed row)."""
    longest = max(packed_lengths)
    if len(packed_lengths) * longest * longest > MAX_MASK_ELEMENTS:
        return False
    packed = forward_cost(len(packed_lengths), longest, hidden_size)
    return packed < forward_cost(rows, row_length, hidden_size)


def pack_shared_prefixes(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_width: int,
    hidden_size: int,
) -> PackedPrefixes | None:
    """The micro-batch packed by prompt group, or ``None`` where packing does not pay (no
    prompt repeats, long rows) or the rows are not left-padded prompt + right-padded
    response."""
    input_ids, attention_mask, position_ids = (
        input_ids.cpu(),
        attention_mask.cpu(),
        position_ids.cpu(),
    )
    rows, width = input_ids.shape
    prompt_width = width - response_width
    if rows < 2 or response_width < 1 or prompt_width < 1:
        return None
    prompt_mask, response_mask = attention_mask[:, :prompt_width], attention_mask[:, prompt_width:]
    if not (_left_padded(prompt_mask) and _right_padded(response_mask)):
        return None
    groups = _prompt_groups(input_ids[:, :prompt_width], prompt_mask)
    count = int(groups.max()) + 1
    if count == rows:
        return None
    prompt_lengths = prompt_mask.sum(-1).tolist()
    # a response's last token predicts nothing: only its first ``length - 1`` are inputs
    response_lengths = (response_mask.sum(-1) - 1).clamp(min=0).tolist()
    members: list[list[int]] = [[] for _ in range(count)]
    for row, group in enumerate(groups.tolist()):
        members[group].append(row)
    packed_lengths = [
        int(prompt_lengths[m[0]]) + sum(int(response_lengths[r]) for r in m) for m in members
    ]
    if not packing_pays(rows, width, packed_lengths, hidden_size):
        return None
    return _build(
        input_ids,
        position_ids,
        prompt_width,
        members,
        prompt_lengths,
        response_lengths,
        max(packed_lengths),
    )


def _build(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    prompt_width: int,
    members: list[list[int]],
    prompt_lengths: list[int],
    response_lengths: list[int],
    length: int,
) -> PackedPrefixes:
    rows, width = input_ids.shape
    response_width = width - prompt_width
    count = len(members)
    ids = torch.zeros(count, length, dtype=input_ids.dtype)
    positions = torch.zeros(count, length, dtype=position_ids.dtype)
    segment = torch.full((count, length), -1, dtype=torch.long)  # 0 prompt, i response i
    predict_from = torch.zeros(rows, response_width, dtype=torch.long)
    for group, rows_of_group in enumerate(members):
        prompt = int(prompt_lengths[rows_of_group[0]])
        first = rows_of_group[0]
        ids[group, :prompt] = input_ids[first, prompt_width - prompt : prompt_width]
        positions[group, :prompt] = position_ids[first, prompt_width - prompt : prompt_width]
        segment[group, :prompt] = 0
        base = group * length
        start = prompt
        for slot, row in enumerate(rows_of_group, start=1):
            fed = int(response_lengths[row])  # the response's tokens but its last
            end = start + fed
            ids[group, start:end] = input_ids[row, prompt_width : prompt_width + fed]
            positions[group, start:end] = position_ids[row, prompt_width : prompt_width + fed]
            segment[group, start:end] = slot
            # token 0 is predicted by the prompt's last position, token t by response t - 1
            sources = torch.full((response_width,), base + prompt - 1, dtype=torch.long)
            sources[1 : fed + 1] = base + torch.arange(start, end)
            predict_from[row] = sources
            start = end
    return PackedPrefixes(
        input_ids=ids,
        position_ids=positions,
        attention_mask=_block_mask(segment),
        predict_from=predict_from,
        padding=int((segment < 0).sum()),
    )


def _block_mask(segment: torch.Tensor) -> torch.Tensor:
    """Causal, and a response sees the prompt and itself; padding sees only itself (a row
    with nothing to attend to would give NaN)."""
    length = segment.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    query, key = segment[:, :, None], segment[:, None, :]
    allowed = causal & (key != -1) & ((key == 0) | (key == query))
    allowed |= torch.eye(length, dtype=torch.bool)
    return allowed[:, None]
