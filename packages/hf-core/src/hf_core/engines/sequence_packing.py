"""Sequence packing: a micro-batch's samples back to back in one row, no padding computed.

A micro-batch of left-padded prompts and right-padded responses spends a forward on every
padding position.  Packed, each sample's real tokens follow the previous sample's in one row
of ``N`` tokens, with position ids restarting at 0 for each sample.  transformers reads that
format itself: given ``position_ids`` and no ``attention_mask`` (and no KV cache) its mask
builder finds where positions restart and lets attention stay inside each sample (a document
mask; varlen kernels on GPU flash attention).  Every token then sees exactly the context it
saw padded: outputs agree to rounding.

With a dense mask (SDPA, eager) the kernel still visits all ``N x N`` pairs, so a packed row of
many samples can cost more attention than the padded rows it replaces;
:func:`sequence_packing_pays` compares both with the same cost model as shared-prefix packing.
On CPU, SDPA with the dense mask was measured faster than FlexAttention's block-sparse mask,
even leaving out FlexAttention's long compile (docs/performance.md, "Measured choices"), so
packing uses the model's attention implementation as it is; a dense packed row is kept under
:data:`MAX_DENSE_PACKED_TOKENS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_core.engines.shared_prefix import forward_cost

MAX_DENSE_PACKED_TOKENS = 4096
"""Longest packed row under a dense mask (SDPA, eager).  Up to about this length packing
pays on CPU (bench/long_context.py); far beyond it a packed row runs slower than padded
micro-batches, which run the causal kernel without a mask while the packed row pays every
masked pair (docs/performance.md, "Measured choices")."""
VARLEN_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3"})
"""Implementations whose packed attention costs only each sample's own pairs."""
PACKABLE_ATTENTION = frozenset({"sdpa", "eager", "flex_attention", *VARLEN_ATTENTION})
"""Implementations transformers gives a document mask from restarting ``position_ids``."""


@dataclass(frozen=True)
class PackedSequences:
    """A micro-batch as one row of its ``N`` real tokens."""

    input_ids: torch.Tensor
    """``[1, N]``."""
    position_ids: torch.Tensor
    """``[1, N]``: each token's position in its own sample (0 at each sample's start)."""
    predict_from: torch.Tensor
    """``[B, R]`` index into the ``N`` packed positions: the one whose output predicts
    response token ``t`` of row ``b`` (a padding token reads a real position, so its output
    stays finite; the response mask drops it)."""


def sequence_packing_pays(
    rows: int, row_length: int, packed: int, hidden_size: int, implementation: str
) -> bool:
    """Whether one packed row of ``packed`` tokens costs less than ``rows`` padded rows of
    ``row_length``: dense work per token (~24 h^2 multiply-adds a layer) against attention
    per query-key pair (~4 h) that a dense mask visits for all pairs of the packed row."""
    if packed >= rows * row_length:
        return False  # nothing to remove
    if implementation in VARLEN_ATTENTION:
        return True
    if packed > MAX_DENSE_PACKED_TOKENS:
        return False
    return forward_cost(1, packed, hidden_size) < forward_cost(rows, row_length, hidden_size)


def pack_sequences(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_width: int,
) -> PackedSequences:
    """The micro-batch's real tokens (``attention_mask == 1``) in row order, as one row.

    Needs every sample's real tokens to be contiguous with positions counting up from 0 (a
    left-padded prompt followed by a right-padded response), the rows rollouts produce.
    """
    mask = attention_mask.bool().cpu()
    keep = mask.reshape(-1)
    packed_ids = input_ids.cpu().reshape(-1)[keep][None]
    packed_positions = position_ids.cpu().reshape(-1)[keep][None]
    # the packed index of each real token; a padding column gets its row's last real one
    index = (keep.long().cumsum(0) - 1).clamp(min=0).view(mask.shape)
    width = mask.shape[1]
    predict_from = index[:, width - response_width - 1 : width - 1]
    return PackedSequences(packed_ids, packed_positions, predict_from)
