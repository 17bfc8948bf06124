"""Routing replay through streaming rollouts (hf_core.engines.streaming), on a toy engine whose
routing is a known function of (token, position, weight version).

- ChunkedStream keeps each request's experts per fed position; a request that a weight update
  reaches mid-response keeps the experts its prefix was first fed with (the re-fed prefix
  does not overwrite them), and positions first fed after the update get the new weights'.
- ``responses_batch`` lays them out like ``input_ids`` (left-padded prompts, right-padded
  responses), unrecorded wherever nothing was fed (padding, each response's last token), and
  the trainer's concatenation of groups of different widths keeps the alignment.
- Without ``routed_experts`` in the parameters nothing is recorded.
"""

from __future__ import annotations

import torch

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, recorded_mask, unrecorded
from hf_core.engines.streaming import ChunkedStream, StreamRequest, responses_batch
from hf_core.trainer.batches import concat_samples

LAYERS, K = 2, 2
MARKER = unrecorded(torch.uint8)


def experts(token: int, position: int, version: int) -> torch.Tensor:
    """The toy's ``[layers, k]`` routing of ``token`` at ``position`` under ``version``."""
    return torch.tensor(
        [
            [(token + position + 5 * version + layer) % 8, (token + 2 * position + 3 * version) % 8]
            for layer in range(LAYERS)
        ],
        dtype=torch.uint8,
    )


def next_token(token: int, version: int) -> int:
    return (token * 7 + 3 + version) % 97 + 3


class RoutingToy:
    """Greedy and deterministic; records the experts of every fed position (prompt tokens and
    every sampled token but the last), as an engine with ``routed_experts`` does."""

    pad_token_id = 0
    eos_token_ids: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.version = 0
        self.calls = 0

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self.calls += 1
        ids, mask = prompts["input_ids"], prompts["attention_mask"]
        rows, width = ids.shape
        budget = params.max_new_tokens
        responses = torch.zeros(rows, budget, dtype=torch.long)
        routed = torch.full((rows, width + budget, LAYERS, K), MARKER, dtype=torch.uint8)
        for row in range(rows):
            real = [(c, int(ids[row, c])) for c in range(width) if mask[row, c]]
            for position, (column, token) in enumerate(real):
                routed[row, column] = experts(token, position, self.version)
            token = real[-1][1]
            for j in range(budget):
                token = next_token(token, self.version)
                responses[row, j] = token
                if j < budget - 1:  # the last sampled token is never fed
                    routed[row, width + j] = experts(token, len(real) + j, self.version)
        out = Batch(
            {
                "responses": responses,
                "response_mask": torch.ones_like(responses),
                "rollout_log_probs": torch.full((rows, budget), -0.5 - self.version),
            }
        )
        if params.routed_experts:
            out[ROUTED_EXPERTS_KEY] = routed
        return out


REPLAY = SamplingParams(temperature=0, max_new_tokens=8, routed_experts=True)


def _requests(params: SamplingParams) -> list[StreamRequest]:
    return [
        StreamRequest((0, 0, 0), [11, 12, 13, 14], params),
        StreamRequest((0, 1, 0), [21, 22], params),  # shorter prompt: left-padded in a chunk
    ]


def _expected(request: StreamRequest) -> torch.Tensor:
    """``[positions, layers, k]``: position ``p``'s experts are those of the forward that
    sampled token ``p + 1`` (the first forward that fed ``p``); the last token has none."""
    sequence = request.prompt + request.tokens
    prompt = len(request.prompt)
    rows = []
    for position, token in enumerate(sequence[:-1]):
        sampled = max(position + 1 - prompt, 0)  # the response token sampled from here
        rows.append(experts(token, position, request.versions[sampled]))
    return torch.stack(rows)


def test_an_interrupted_request_keeps_its_prefix_routing_and_gets_the_new_for_new_tokens() -> None:
    engine = RoutingToy()
    stream = ChunkedStream(engine, chunk_tokens=3)
    requests = _requests(REPLAY)
    stream.admit(requests)
    assert stream.advance(0) == []
    first, second = requests
    # fed: the prompt and the chunk's tokens but its last (sampled, not yet fed)
    assert first.routed_positions == 4 + 2 and second.routed_positions == 2 + 2
    before = first.routed.clone() if first.routed is not None else None
    engine.version = 1  # a weight update between two chunks
    stream.weights_changed()
    done: list[StreamRequest] = []
    version = 1
    while stream.active:
        done += stream.advance(version)
    assert {r.key for r in done} == {first.key, second.key}
    assert first.versions == second.versions == [0, 0, 0, 1, 1, 1, 1, 1]
    for request in requests:
        length = len(request.prompt) + len(request.tokens)
        assert request.routed_positions == length - 1  # all fed but the last token
        assert request.routed is not None
        assert torch.equal(request.routed, _expected(request))
    assert before is not None and first.routed is not None
    assert torch.equal(first.routed[:6], before)  # the re-fed prefix kept its first record
    # ... which differs from what the new weights route it to (re-fed in every later chunk)
    again = torch.stack([experts(t, p, 1) for p, t in enumerate(first.prompt)])
    assert not torch.equal(first.routed[:4], again)
    # position 6 (the first chunk's last token) was first fed after the update: new routing
    assert torch.equal(first.routed[6], experts(first.tokens[2], 6, 1))


def test_the_batch_lays_routing_out_like_input_ids() -> None:
    engine = RoutingToy()
    stream = ChunkedStream(engine, chunk_tokens=3)
    requests = _requests(REPLAY)
    stream.admit(requests)
    stream.advance(0)
    engine.version = 1
    stream.weights_changed()
    while stream.active:
        stream.advance(1)
    batch = responses_batch(requests, 0)
    routed = batch[ROUTED_EXPERTS_KEY]
    assert routed.shape == (*batch["input_ids"].shape, LAYERS, K) and routed.dtype == torch.uint8
    _check_layout(batch, requests)
    # the trainer joins groups of other widths: prompts padded left, responses right
    short = REPLAY.model_copy(update={"max_new_tokens": 5})
    other = [StreamRequest((0, 2, 0), [31, 32, 33, 34, 35, 36], short)]
    stream.admit(other)
    while stream.active:
        stream.advance(1)
    joined = concat_samples([batch, responses_batch(other, 0)])
    assert joined[ROUTED_EXPERTS_KEY].shape[:2] == joined["input_ids"].shape
    _check_layout(joined, [*requests, *other])


def _check_layout(batch: Batch, requests: list[StreamRequest]) -> None:
    """Every recorded column holds the experts of its input_ids token at its position; the
    unrecorded ones are exactly the padding and each response's last token."""
    routed, ids = batch[ROUTED_EXPERTS_KEY], batch["input_ids"]
    mask, positions = batch["attention_mask"], batch["position_ids"]
    prompt_width = batch["prompts"].shape[1]
    for row, request in enumerate(requests):
        last = prompt_width + len(request.tokens) - 1
        expected = _expected(request)
        for column in range(ids.shape[1]):
            here = routed[row, column]
            if not mask[row, column] or column == last:
                assert not bool(recorded_mask(here).any()), (row, column)
                continue
            position = int(positions[row, column])
            assert torch.equal(here, expected[position]), (row, column)
            token = int(ids[row, column])
            assert any(torch.equal(here, experts(token, position, v)) for v in (0, 1))


def test_without_routed_experts_nothing_is_recorded() -> None:
    stream = ChunkedStream(RoutingToy(), chunk_tokens=4)
    requests = _requests(REPLAY.model_copy(update={"routed_experts": False}))
    stream.admit(requests)
    while stream.active:
        stream.advance(0)
    assert all(r.routed is None for r in requests)
    assert ROUTED_EXPERTS_KEY not in responses_batch(requests, 0)
