"""Streaming's sample buffer and prompt ledger (hf_core.trainer.sample_stream)."""

from __future__ import annotations

import pytest
import torch

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_core.engines.streaming import StreamRequest, responses_batch
from hf_core.trainer.batches import concat_samples
from hf_core.trainer.sample_stream import (
    TOKEN_VERSIONS,
    GroupBuffer,
    PromptLedger,
    oldest_versions,
    version_spread,
)


def _samples(versions: list[list[int]], lengths: list[int], tag: int = 0) -> Batch:
    width = len(versions[0])
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    return Batch(
        {
            TOKEN_VERSIONS: torch.tensor(versions),
            "response_mask": mask,
            "tag": torch.full((len(lengths),), tag),
        }
    )


def test_versions_ignore_padding_and_spread_marks_mid_generation_updates() -> None:
    versions = torch.tensor([[3, 3, 4, 9], [2, 2, 2, 0], [5, 6, 0, 0], [7, 7, 7, 7]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert oldest_versions(versions, mask).tolist() == [3, 0, 5, 9]  # empty: never stale
    assert version_spread(versions, mask).tolist() == [1, 2, 1, 0]


def test_a_group_is_handed_over_when_its_last_sample_arrives() -> None:
    buffer = GroupBuffer(group_size=3)
    assert buffer.add((0, 7), _samples([[1, 1]], [2], tag=1)) is None
    assert buffer.add((0, 8), _samples([[1, 1]] * 3, [1, 2, 2], tag=2)) is not None
    assert buffer.depth == 1 and buffer.unfinished() == [(0, 7)]
    group = buffer.add((0, 7), _samples([[1, 2]] * 2, [2, 2], tag=1))
    assert group is not None and len(group.samples) == 3
    assert group.samples["tag"].tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="4 samples for groups of 3"):
        buffer.add((0, 9), _samples([[1, 1]] * 4, [1] * 4))


def test_take_keeps_finish_order_and_drops_groups_too_old_to_train() -> None:
    buffer = GroupBuffer(group_size=1)
    # oldest tokens at versions 5, 2, 4, 6; training version 6 with max_staleness 2
    for index, first in enumerate([5, 2, 4, 6]):
        buffer.add((0, index), _samples([[first, 6]], [2]))
    kept, dropped = buffer.take(2, train_version=6, max_staleness=2)
    assert [g.prompt_id for g in kept] == [(0, 0), (0, 2)]
    assert [g.prompt_id for g in dropped] == [(0, 1)]
    assert buffer.depth == 1  # (0, 3) waits for the next step
    kept, dropped = buffer.take(5, train_version=6, max_staleness=0)
    assert [g.prompt_id for g in kept] == [(0, 3)] and dropped == []


def test_the_ledger_accounts_for_every_prompt_and_resumes() -> None:
    ledger = PromptLedger()
    ledger.issued([(0, 1), (0, 2), (0, 3), (0, 4)])
    ledger.trained([(0, 1)], step=1)
    ledger.dropped([(0, 2)], "stale")
    ledger.lost([(0, 3)], "rollout rank 1 died")
    assert ledger.in_flight() == [(0, 4)]
    assert ledger.counts() == {
        "prompts/in_flight": 1.0,
        "prompts/trained": 1.0,
        "prompts/dropped": 1.0,
        "prompts/lost": 1.0,
    }
    with pytest.raises(ValueError, match=r"\(0, 1\) is trained, not in flight"):
        ledger.trained([(0, 1)], step=2)  # never trained twice
    with pytest.raises(ValueError, match="drawn again after it was trained"):
        ledger.issued([(0, 1)])
    ledger.issued([(1, 1)])  # the same record in the next epoch is another prompt
    resumed = PromptLedger()
    resumed.load_state_dict(ledger.state_dict())
    assert resumed.rows() == ledger.rows()
    assert resumed.in_flight() == [(0, 4), (1, 1)]
    with pytest.raises(ValueError, match="unknown state 'gone'"):
        resumed.load_state_dict(
            {"rows": [{"epoch": 0, "sample_index": 1, "state": "gone", "detail": None}]}
        )


def _request(index: int, sample: int, prompt: int, versions: list[int]) -> StreamRequest:
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.7)
    request = StreamRequest((0, index, sample), list(range(3, 3 + prompt)), params)
    for position, version in enumerate(versions):
        request.extend([40 + position], [-0.5 - position], version)
    return request


def test_groups_of_requests_become_the_rows_per_group_batches_would() -> None:
    """The step's rows are built once from every group's requests; they must equal the
    rows of one batch per group padded together (what the step took before)."""
    groups = [
        [_request(1, 0, 2, [3, 3, 4]), _request(1, 1, 2, [4])],
        [_request(2, 0, 5, [4, 4, 4, 4, 4, 4]), _request(2, 1, 5, [])],
    ]
    whole = responses_batch([r for g in groups for r in g], pad_token_id=0)
    per_group = concat_samples([responses_batch(g, pad_token_id=0) for g in groups])
    assert sorted(whole.keys()) == sorted(per_group.keys())
    for key in whole.keys():
        assert torch.equal(whole[key], per_group[key]), key
    assert whole.meta["temperature"] == 0.7
    assert whole["responses"].tolist()[:2] == [[40, 41, 42, 0, 0, 0], [40, 0, 0, 0, 0, 0]]
    assert whole["response_mask"].tolist()[3] == [0] * 6  # the empty response
    assert whole["token_versions"].tolist()[:2] == [[3, 3, 4, -1, -1, -1], [4, -1, -1, -1, -1, -1]]
    assert whole["rollout_log_probs"][0, :3].tolist() == [-0.5, -1.5, -2.5]
    assert whole["interrupted"].tolist() == [True, False, False, False]


def test_a_group_of_requests_is_as_old_as_its_oldest_token() -> None:
    buffer = GroupBuffer(group_size=2)
    buffer.add_requests((0, 1), [_request(1, 0, 2, [3, 5]), _request(1, 1, 2, [5])])
    buffer.add_requests((0, 2), [_request(2, 0, 2, []), _request(2, 1, 2, [])])  # no token
    buffer.add_requests((0, 3), [_request(3, 0, 2, [5]), _request(3, 1, 2, [4, 5])])
    with pytest.raises(ValueError, match="1 samples for groups of 2"):
        buffer.add_requests((0, 4), [_request(4, 0, 2, [5])])
    kept, dropped = buffer.take(3, train_version=5, max_staleness=1)
    assert [g.prompt_id for g in dropped] == [(0, 1)]  # version 3 is 2 behind
    assert [g.prompt_id for g in kept] == [(0, 2), (0, 3)]  # no token: never stale
    assert [g.oldest for g in kept] == [None, 4]
