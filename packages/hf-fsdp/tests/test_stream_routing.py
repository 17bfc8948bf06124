"""Routing replay through the transformers engine's token stream on a mixture-of-experts model
(the tiny Qwen3-MoE; its stream is a ChunkedStream over the engine's own generation, since the
lean decoder is dense-only).

- Each streamed request's recorded experts are transformers' routers' (RoutingRecorder) over
  its final sequence, for every fed position, and so they are across a weight sync of
  unchanged weights (the prefix fed again after it routes the same).
- With the router changed mid-response, the positions fed before the update keep the old
  router's experts and the positions first fed after it have the new router's (control: the
  two routers disagree on the prefix).
- The assembled batch carries them in the rollout engines' layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_core.engines import SamplingParams
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, recorded_mask, same_sets
from hf_core.engines.streaming import ChunkedStream, StreamRequest, TokenStream, responses_batch
from hf_fsdp.moe_routing import RoutingRecorder, moe_routers
from hf_fsdp.rollout import TransformersRolloutEngine

REPLAY = SamplingParams(temperature=0, max_new_tokens=10, routed_experts=True)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def _engine(path: Path) -> TransformersRolloutEngine:
    return TransformersRolloutEngine({"model_path": str(path), "dtype": "float32"})


def _requests(count: int) -> list[StreamRequest]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (3 + i % 4,), generator=gen).tolist() for i in range(count)]
    return [StreamRequest((0, i, 0), p, REPLAY) for i, p in enumerate(prompts)]


def _drain(stream: TokenStream, version: int) -> list[StreamRequest]:
    done: list[StreamRequest] = []
    while stream.active:
        done += stream.advance(version)
    return done


def _routers(engine: TransformersRolloutEngine, sequence: list[int]) -> torch.Tensor:
    """transformers' own ``[positions, layers, k]`` routing of ``sequence`` (one row)."""
    ids = torch.tensor([sequence])
    with torch.no_grad(), RoutingRecorder(engine.model) as recorder:
        engine.model(input_ids=ids, attention_mask=torch.ones_like(ids))
        return recorder.take(*ids.shape)[0]


def _router_weights(engine: TransformersRolloutEngine) -> dict[str, torch.Tensor]:
    names = {id(r.weight) for r in moe_routers(engine.model)}
    return {n: t.clone() for n, t in engine._targets.items() if id(t) in names}


def test_streamed_routing_is_the_routers_own_across_an_unchanged_sync(moe_path: Path) -> None:
    engine = _engine(moe_path)
    stream = engine.open_stream(4, 3)
    assert isinstance(stream, ChunkedStream)  # MoE: transformers' forward, in chunks
    requests = _requests(5)
    stream.admit(requests)
    done = stream.advance(0)
    routers = _router_weights(engine)
    assert routers  # the canonical names of the routers' weights
    engine.load_weights(_router_weights(engine).items())  # the same weights again
    engine.finish_weight_sync()
    stream.weights_changed()
    done += _drain(stream, 1)
    assert sorted(r.key for r in done) == [r.key for r in requests]
    assert any(len(r.tokens) > 3 for r in requests)  # responses spanned the sync
    for request in requests:
        sequence = request.prompt + request.tokens
        assert request.routed is not None
        assert request.routed_positions == len(sequence) - 1  # all fed but the last token
        own = _routers(engine, sequence)[:-1]
        assert bool(same_sets(request.routed, own).all()), request.key
    batch = responses_batch(requests, engine.pad_token_id)
    routed = batch[ROUTED_EXPERTS_KEY]
    assert routed.shape[:2] == batch["input_ids"].shape
    assert routed.shape[2:] == (len(moe_routers(engine.model)), 2)
    recorded = recorded_mask(routed).all(-1).all(-1)
    fed = batch["attention_mask"].bool().clone()
    prompt_width = batch["prompts"].shape[1]
    for row, request in enumerate(requests):
        fed[row, prompt_width + len(request.tokens) - 1] = False  # the last token: never fed
    assert torch.equal(recorded, fed)


def test_a_router_changed_mid_response_keeps_the_prefixs_first_routing(moe_path: Path) -> None:
    engine = _engine(moe_path)
    stream = engine.open_stream(4, 3)
    requests = _requests(4)
    stream.admit(requests)
    assert not stream.advance(0)
    first = {r.key: r.routed_positions for r in requests}
    old = _router_weights(engine)
    gen = torch.Generator().manual_seed(11)
    new = {n: t + 2.0 * torch.randn(t.shape, generator=gen) for n, t in old.items()}
    engine.load_weights(new.items())
    engine.finish_weight_sync()
    stream.weights_changed()
    _drain(stream, 1)
    changed = 0
    for request in requests:
        sequence = request.prompt + request.tokens
        assert request.routed is not None and request.routed_positions == len(sequence) - 1
        known = first[request.key]
        engine.load_weights(new.items())
        after = _routers(engine, sequence)[:-1]
        engine.load_weights(old.items())
        before = _routers(engine, sequence)[:-1]
        assert bool(same_sets(request.routed[:known], before[:known]).all()), request.key
        assert bool(same_sets(request.routed[known:], after[known:]).all()), request.key
        changed += int((~same_sets(before[:known], after[:known])).sum())
    assert changed > 0  # control: the new router routes the prefix otherwise
