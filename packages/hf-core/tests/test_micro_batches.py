"""Token-budget micro-batches: grouping by length, padding trimmed, outputs restored."""

from __future__ import annotations

import torch

from hf_core.batch import Batch
from hf_core.engines import restore_outputs, split_micro_batches
from hf_core.engines.micro_batches import trim_padding


def _rollouts(prompt_lens: list[int], response_lens: list[int], p: int = 6, r: int = 5) -> Batch:
    rows = len(prompt_lens)
    prompt_mask = torch.zeros(rows, p, dtype=torch.long)
    response_mask = torch.zeros(rows, r, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        prompt_mask[i, p - pl :] = 1  # left-padded
        response_mask[i, :rl] = 1  # right-padded
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    ids = torch.arange(rows * (p + r)).reshape(rows, p + r) * mask
    return Batch(
        {
            "prompts": ids[:, :p],
            "responses": ids[:, p:],
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask,
            "advantages": torch.randn(rows, r),
            "scores": torch.arange(rows, dtype=torch.float32),
        },
        meta={"temperature": 0.7},
    )


def test_trim_removes_only_columns_every_row_pads() -> None:
    batch = _rollouts([2, 3], [1, 3])
    trimmed = trim_padding(batch)
    assert trimmed["input_ids"].shape == (2, 3 + 3)  # longest prompt 3, longest response 3
    assert trimmed["prompts"].shape == (2, 3)
    assert trimmed["responses"].shape == trimmed["advantages"].shape == (2, 3)
    assert trimmed["scores"].shape == (2,)
    assert trimmed.meta["temperature"] == 0.7
    # every real token and its mask survive; only all-pad columns went
    assert int(trimmed["attention_mask"].sum()) == int(batch["attention_mask"].sum())
    assert int(trimmed["response_mask"].sum()) == int(batch["response_mask"].sum())
    assert torch.equal(trimmed["advantages"], batch["advantages"][:, :3])
    assert torch.equal(trimmed["input_ids"], batch["input_ids"][:, 3:9])


def test_budget_groups_by_length_and_bounds_padded_tokens() -> None:
    lengths = [(1, 1), (6, 5), (2, 1), (6, 4), (1, 2), (5, 5)]
    batch = _rollouts([p for p, _ in lengths], [r for _, r in lengths])
    micro = split_micro_batches(batch, max_tokens=12)
    rows = torch.cat([m.rows for m in micro])
    assert sorted(rows.tolist()) == list(range(len(batch)))  # each row exactly once
    for m in micro:
        tokens = m.batch["input_ids"].numel()
        assert tokens <= 12 or len(m.batch) == 1, (m.rows, tokens)
    # short rows travel together, long ones apart: fewer padded tokens than fixed chunks
    padded = sum(m.batch["input_ids"].numel() for m in micro)
    fixed = sum(trim_padding(b)["input_ids"].numel() for b in batch.split(2))
    assert padded < fixed


def test_sample_cap_and_no_budget_keep_fixed_chunks() -> None:
    batch = _rollouts([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    micro = split_micro_batches(batch, max_tokens=None, max_samples=2)
    assert [m.rows.tolist() for m in micro] == [[0, 1], [2, 3], [4]]
    capped = split_micro_batches(batch, max_tokens=10_000, max_samples=2)
    assert all(len(m.batch) <= 2 for m in capped)


def test_outputs_come_back_in_order_and_width() -> None:
    batch = _rollouts([1, 6, 2, 5], [1, 5, 2, 4])
    micro = split_micro_batches(batch, max_tokens=14)
    outputs = [
        {"log_probs": m.batch["advantages"] * 2, "scores": m.batch["scores"] + 1} for m in micro
    ]
    merged = restore_outputs(outputs, micro, len(batch), width=5)
    mask = batch["response_mask"].bool()
    assert torch.equal(merged["log_probs"][mask], (batch["advantages"] * 2)[mask])
    assert merged["log_probs"].shape == (4, 5)
    for m in micro:  # columns a micro-batch trimmed away come back as zeros
        width = m.batch["responses"].shape[1]
        assert not merged["log_probs"][m.rows, width:].any()
    assert torch.equal(merged["scores"], batch["scores"] + 1)


def test_prompt_groups_stay_in_one_micro_batch_where_they_fit() -> None:
    # three groups of two rows; lengths interleave across groups, so a plain length sort
    # would put each group's rows into different micro-batches
    lengths = [(2, 1), (2, 5), (4, 2), (4, 4), (3, 3), (3, 1)]
    batch = _rollouts([p for p, _ in lengths], [r for _, r in lengths])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    plain = split_micro_batches(batch, max_tokens=20)
    assert any(len(set(groups[m.rows].tolist())) > 1 for m in plain)  # groups split apart
    micro = split_micro_batches(batch, max_tokens=20, prompt_groups=groups)
    assert sorted(torch.cat([m.rows for m in micro]).tolist()) == list(range(6))
    for m in micro:
        assert m.batch["input_ids"].numel() <= 20
        for g in set(groups[m.rows].tolist()):  # a group present is present whole
            assert set(torch.nonzero(groups == g).flatten().tolist()) <= set(m.rows.tolist())
    # a group larger than the budget is split by length, still under it
    one_group = torch.zeros(6, dtype=torch.long)
    split = split_micro_batches(batch, max_tokens=12, prompt_groups=one_group)
    assert len(split) > 1
    real = batch["attention_mask"].sum(-1)
    assert all(len(m.rows) * int(real[m.rows].max()) <= 12 or len(m.rows) == 1 for m in split)
    # no repeated prompt: the plain plan, unchanged
    unique = split_micro_batches(batch, max_tokens=20, prompt_groups=torch.arange(6))
    assert [m.rows.tolist() for m in unique] == [m.rows.tolist() for m in plain]
