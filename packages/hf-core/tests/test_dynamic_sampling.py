"""DAPO's dynamic sampling: only groups with differing rewards train, extra draws are counted,
and the rollout source hears which groups were left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from hf_core.batch import Batch
from hf_core.config import TrainerConfig
from hf_core.engines import SamplingParams
from hf_core.trainer.dynamic_sampling import (
    FILTERED_REASON,
    SURPLUS_REASON,
    DynamicSampler,
    mixed_groups,
)
from hf_core.trainer.rollout_source import RolloutSource, StepSamples

N = 4
BATCH = 6


class PatternRollouts(RolloutSource):
    """Draws ``BATCH`` prompts per call; prompt ``i`` is mixed when ``mixed(i)``.  Each
    draw's responses get a width of their own, as real draws do."""

    def __init__(self, mixed: Any) -> None:
        self.mixed = mixed
        self.next_id = 0
        self.draws: list[int] = []
        """``groups`` asked for by each extra draw."""
        self.discarded: list[tuple[list[int], str]] = []
        self._metrics = {}

    def _draw(self, step: int) -> StepSamples:
        ids = torch.arange(self.next_id, self.next_id + BATCH)
        self.next_id += BATCH
        width = 3 + len(self.draws)
        rows = BATCH * N
        generated = Batch(
            {
                "prompts": torch.ones(rows, 2, dtype=torch.long),
                "responses": torch.full((rows, width), 7),
                "input_ids": torch.ones(rows, 2 + width, dtype=torch.long),
                "attention_mask": torch.ones(rows, 2 + width, dtype=torch.long),
                "position_ids": torch.arange(2 + width).repeat(rows, 1),
                "response_mask": torch.ones(rows, width, dtype=torch.long),
                "rollout_log_probs": torch.zeros(rows, width),
            }
        )
        prompt_width = 2 + len(self.draws)  # loader batches are padded to their longest
        prompts = Batch(
            {
                "prompt_id": ids,
                "input_ids": torch.ones(BATCH, prompt_width, dtype=torch.long),
                "attention_mask": torch.ones(BATCH, prompt_width, dtype=torch.long),
            }
        )
        return StepSamples(step, prompts, generated, version=step - 1)

    def take(self, step: int) -> StepSamples:
        return self._draw(step)

    def take_more(self, step: int, round_: int, groups: int) -> StepSamples:
        self.draws.append(groups)
        return self._draw(step)

    def discard(self, samples: StepSamples, groups: list[int], reason: str) -> None:
        ids = samples.prompts["prompt_id"]
        self.discarded.append(([int(ids[g]) for g in groups], reason))

    def after_update(self, step: int) -> dict[str, float]:
        return {}

    def sync(self, version: int) -> dict[str, float]:
        return {}

    def generate_now(self, prompts: Batch, params: SamplingParams) -> Batch:
        raise AssertionError("not used")


def _join(samples: StepSamples) -> Batch:
    batch = samples.generated.select(*samples.generated.keys())
    batch["prompt_id"] = samples.prompts["prompt_id"].repeat_interleave(N)
    return batch


def _sampler(rollouts: PatternRollouts, max_rounds: int = 4) -> DynamicSampler:
    def score(batch: Batch) -> torch.Tensor:
        ids = batch["prompt_id"]
        within = torch.arange(len(ids)) % N
        mixed = torch.tensor([bool(rollouts.mixed(int(i))) for i in ids])
        return torch.where(mixed, (within == 0).float(), torch.ones(len(ids)))

    return DynamicSampler(
        rollouts, batch_size=BATCH, group_size=N, max_rounds=max_rounds, join=_join, score=score
    )


def test_mixed_groups_flags_groups_whose_rewards_differ() -> None:
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    assert mixed_groups(scores, 4).tolist() == [True, False]
    with pytest.raises(ValueError, match="groups of 3"):
        mixed_groups(scores, 3)


def test_half_uniform_groups_are_filtered_and_more_prompts_drawn() -> None:
    rollouts = PatternRollouts(mixed=lambda i: i % 2 == 0)  # half the groups all agree
    filled = _sampler(rollouts).fill(1, rollouts.take(1))

    kept = filled.batch["prompt_id"].reshape(-1, N)[:, 0]
    assert len(filled.prompts) == BATCH and len(filled.batch) == BATCH * N
    assert all(int(i) % 2 == 0 for i in kept)
    assert mixed_groups(filled.scores, N).all()
    assert filled.prompts["prompt_id"].tolist() == kept.tolist()
    assert filled.batch["group_index"].tolist() == torch.arange(BATCH).repeat_interleave(N).tolist()
    # 3 mixed per draw of 6: the first draw and one extra give 6; the extra asked for 3
    assert rollouts.draws == [3]
    assert filled.metrics["dynamic_sampling/groups_drawn"] == 12
    assert filled.metrics["dynamic_sampling/groups_kept"] == BATCH
    assert filled.metrics["dynamic_sampling/rounds"] == 2
    assert filled.metrics["dynamic_sampling/uniform_groups_trained"] == 0
    filtered = [i for ids, why in rollouts.discarded if why == FILTERED_REASON for i in ids]
    assert sorted(filtered) == [1, 3, 5, 7, 9, 11]
    # responses of different widths were padded to one width, masks kept
    assert filled.batch["responses"].shape[1] == 4
    assert filled.prompts["input_ids"].shape[1] == 3
    assert filled.prompts["attention_mask"][0].tolist() == [0, 1, 1]
    assert int(filled.batch["response_mask"][:N].sum()) == N * 3


def test_surplus_mixed_groups_beyond_the_batch_are_discarded() -> None:
    rollouts = PatternRollouts(mixed=lambda i: i % 3 != 0)  # 4 of 6 mixed per draw
    filled = _sampler(rollouts).fill(1, rollouts.take(1))
    assert len(filled.prompts) == BATCH
    surplus = [i for ids, why in rollouts.discarded if why == SURPLUS_REASON for i in ids]
    assert surplus == [10, 11]
    assert filled.prompts["prompt_id"].tolist() == [1, 2, 4, 5, 7, 8]


def test_rounds_cap_fills_the_batch_with_uniform_groups_and_says_so() -> None:
    rollouts = PatternRollouts(mixed=lambda i: i == 0)  # one mixed group in all
    filled = _sampler(rollouts, max_rounds=2).fill(1, rollouts.take(1))
    assert len(rollouts.draws) == 2
    assert len(filled.prompts) == BATCH
    assert filled.metrics["dynamic_sampling/groups_kept"] == 1
    assert filled.metrics["dynamic_sampling/short_groups"] == BATCH - 1
    assert filled.metrics["dynamic_sampling/uniform_groups_trained"] == BATCH - 1
    assert filled.prompts["prompt_id"].tolist() == [0, 1, 2, 3, 4, 5]


def test_all_mixed_draws_nothing_extra() -> None:
    rollouts = PatternRollouts(mixed=lambda i: True)
    filled = _sampler(rollouts).fill(1, rollouts.take(1))
    assert rollouts.draws == [] and rollouts.discarded == [
        ([], FILTERED_REASON),
        ([], SURPLUS_REASON),
    ]
    assert filled.metrics["dynamic_sampling/kept_frac"] == 1.0


def _config(tmp_path: Path, **sections: Any) -> TrainerConfig:
    doc: dict[str, Any] = {
        "model": {"path": str(tmp_path)},
        "reward": {"function": "digits_reverse"},
        "rollout": {"n": 4},
        "algorithm": {"dynamic_sampling": {"enabled": True}},
    }
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value}
    return TrainerConfig.model_validate(doc)


def test_dynamic_sampling_needs_groups(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"rollout\.n >= 2"):
        _config(tmp_path, rollout={"n": 1})


def test_dynamic_sampling_with_batches_queued_ahead_asks_for_streaming(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"rollout\.mode: streaming"):
        _config(tmp_path, placement={"mode": "standalone"}, rollout={"n": 4, "max_staleness": 1})
    _config(
        tmp_path,
        placement={"mode": "standalone"},
        rollout={"n": 4, "max_staleness": 1, "mode": "streaming"},
    )
