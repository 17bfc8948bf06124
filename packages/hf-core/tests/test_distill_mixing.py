"""GKD's mix: some prompt groups' samples replaced by their dataset completion."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from hf_core.batch import Batch
from hf_core.trainer.distill_mixing import mix_in_completions, mixed_prompts, off_policy_prompts
from hf_testing.tiny import build_tiny_model

N = 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    folder = build_tiny_model(tmp_path_factory.mktemp("tok") / "model")
    return AutoTokenizer.from_pretrained(folder)


def _prompts(tokenizer: object, texts: list[str], answers: list[str]) -> Batch:
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]  # type: ignore[operator]
    width = max(map(len, ids))
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return Batch(
        {"input_ids": input_ids, "attention_mask": mask},
        {"ground_truth": np.array(answers, dtype=object)},
    )


def _samples(prompts: Batch) -> Batch:
    """What the rollout returned: ``N`` samples a prompt, 3 response tokens each."""
    rows = len(prompts) * N
    prompt_ids = prompts["input_ids"].repeat_interleave(N, 0)
    responses = torch.full((rows, 3), 7)
    mask = torch.ones(rows, 3, dtype=torch.long)
    attention = torch.cat([prompts["attention_mask"].repeat_interleave(N, 0), mask], 1)
    return Batch(
        {
            "prompts": prompt_ids,
            "responses": responses,
            "response_mask": mask,
            "input_ids": torch.cat([prompt_ids, responses], 1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "rollout_log_probs": torch.full((rows, 3), -1.5),
            "policy_version": torch.full((rows,), 4),
            "rollout_version": torch.full((rows,), 3),  # a streaming pool's keys
            "interrupted": torch.ones(rows, dtype=torch.bool),
            "token_versions": torch.full((rows, 3), 3),
            "group_index": torch.arange(len(prompts)).repeat_interleave(N),
        },
        {"ground_truth": prompts["ground_truth"].repeat(N)},
    )


def test_the_off_policy_share_is_drawn_per_step_and_reproducibly() -> None:
    first = off_policy_prompts(8, 0.75, seed=0, step=3)
    assert int(first.sum()) == 2
    assert torch.equal(first, off_policy_prompts(8, 0.75, seed=0, step=3))
    draws = {tuple(off_policy_prompts(8, 0.75, seed=0, step=s).tolist()) for s in range(10)}
    assert len(draws) > 1  # another step, other prompts
    assert not off_policy_prompts(8, 1.0, 0, 1).any()
    assert off_policy_prompts(8, 0.0, 0, 1).all()


def test_completions_replace_their_groups_and_keep_the_batch_whole(tokenizer: object) -> None:
    prompts = _prompts(tokenizer, ["12", "345", "6"], ["21", "543", "6"])
    batch = _samples(prompts)
    off = torch.tensor([False, True, False])
    mixed = mix_in_completions(
        batch, prompts, off, n=N, tokenizer=tokenizer, completion_key="ground_truth", version=4
    )
    out = mixed.batch
    assert mixed.off_policy.tolist() == [False] * 4 + [True] * 2
    assert out["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert list(out["ground_truth"]) == ["21", "21", "6", "6", "543", "543"]
    # the completion is the response: its tokens then EOS, trained on; the samples' width
    # grows to the longest response, padded and masked
    want = tokenizer("543", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]  # type: ignore[operator,attr-defined]
    width = out["responses"].shape[1]
    assert width == max(3, len(want))
    assert out["responses"][4, : len(want)].tolist() == want
    assert out["response_mask"][4].tolist() == [1] * len(want) + [0] * (width - len(want))
    assert out["response_mask"][0].tolist() == [1, 1, 1] + [0] * (width - 3)
    assert torch.equal(out["input_ids"][:, -width:], out["responses"])
    assert out["policy_version"].tolist() == [4] * 6
    assert out["rollout_version"].tolist() == [3] * 4 + [4] * 2
    assert out["interrupted"].tolist() == [True] * 4 + [False] * 2
    versions = out["token_versions"][4:]
    assert (versions[out["response_mask"][4:] == 1] == 4).all()
    assert (versions[out["response_mask"][4:] == 0] == -1).all()
    assert torch.equal(out["rollout_log_probs"][4:], torch.zeros(2, width))  # computed after
    assert list(mixed_prompts(prompts, off)["ground_truth"]) == ["21", "6", "543"]


def test_a_missing_completion_field_or_an_unknown_sample_key_is_named(tokenizer: object) -> None:
    prompts = _prompts(tokenizer, ["12", "3"], ["21", "3"])
    batch = _samples(prompts)
    off = torch.tensor([True, False])
    with pytest.raises(KeyError, match=r"completion_key.*'answer'"):
        mix_in_completions(
            batch, prompts, off, n=N, tokenizer=tokenizer, completion_key="answer", version=0
        )
    batch["routed_experts"] = torch.zeros(4, 5, dtype=torch.int8)
    with pytest.raises(ValueError, match="routed_experts"):
        mix_in_completions(
            batch, prompts, off, n=N, tokenizer=tokenizer, completion_key="ground_truth", version=0
        )
