"""Shared-prefix packing: which rows share a prompt, the packed layout, and when it pays."""

from __future__ import annotations

import torch

from hf_core.engines.shared_prefix import (
    MAX_MASK_ELEMENTS,
    pack_shared_prefixes,
    packing_pays,
    prompt_groups,
)


def _rows(prompts: list[list[int]], responses: list[list[int]], p: int = 4, r: int = 3):
    """Left-padded prompts + right-padded responses (pad 0), and positions from the mask."""
    rows = len(prompts)
    ids = torch.zeros(rows, p + r, dtype=torch.long)
    mask = torch.zeros(rows, p + r, dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        mask[i, p - len(prompt) : p] = 1
        ids[i, p : p + len(response)] = torch.tensor(response)
        mask[i, p : p + len(response)] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_groups_are_rows_with_the_same_real_prompt_in_order_of_first_appearance() -> None:
    ids, mask, _ = _rows([[7, 8], [5], [7, 8], [5], [6, 8]], [[1], [2], [3], [4], [5]])
    assert prompt_groups(ids, mask, 3).tolist() == [0, 1, 0, 1, 2]


def test_packed_layout_gives_each_response_token_its_own_context() -> None:
    prompts = [[7, 8, 9], [7, 8, 9], [5, 6]]
    responses = [[11, 12, 13], [21], [31, 32]]
    ids, mask, positions = _rows(prompts, responses)
    packed = pack_shared_prefixes(ids, mask, positions, 3, hidden_size=1024)
    assert packed is not None
    # group 0: prompt once, then each response but its last token (an input to nothing);
    # group 1 alone
    assert packed.input_ids.tolist() == [[7, 8, 9, 11, 12], [5, 6, 31, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]
    length = packed.input_ids.shape[1]
    allowed = packed.attention_mask[:, 0].reshape(-1, length)  # [G * L, L]
    for row in range(3):
        for t in range(len(responses[row])):
            source = int(packed.predict_from[row, t])
            # the predicting position is the token just before t in this row's own sequence
            group = packed.input_ids[source // length]
            context = group[allowed[source].nonzero().flatten()]
            assert context.tolist() == prompts[row] + responses[row][:t], (row, t)
    # padding predicts from a real position (finite outputs), never from another group
    assert packed.predict_from[1, 1:].tolist() == [2, 2]
    assert int(packed.predict_from[2, 0]) // length == 1


def test_no_packing_without_repeats_or_when_rows_are_long() -> None:
    ids, mask, positions = _rows([[7, 8], [5, 6]], [[1, 2], [3]])
    assert pack_shared_prefixes(ids, mask, positions, 3, hidden_size=64) is None
    # two 8-token prompts shared by 8 responses of 1,000 tokens: attention over the packed
    # 8,008 tokens costs more than the 7 prompts saved
    assert not packing_pays(8, 1008, [8 + 8 * 1000], hidden_size=64)
    assert packing_pays(4, 46, [14 + 4 * 32], hidden_size=512)
    assert not packing_pays(2, 100, [int(MAX_MASK_ELEMENTS**0.5) + 1], hidden_size=10**6)
    # a response with a hole in its mask is not the layout packing assumes
    ids, mask, positions = _rows([[7, 8], [7, 8]], [[1, 2, 3], [4, 5]])
    mask[0, 5] = 0
    assert pack_shared_prefixes(ids, mask, positions, 3, hidden_size=1024) is None
