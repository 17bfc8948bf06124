"""The transformers engine's token stream (continuous batching for streaming rollouts).

- Requests that join a running decode at different times, and leave it when they end, get
  the tokens and log-probs a plain generate gives each alone (greedy, float32).
- A weight update mid-response: the tokens after it are the new weights' (the prefix is
  prefilled again), so each token's log-prob is the one its own version's forward gives it:
  what the trainer's per-token importance weights divide by.
- The ChunkedStream fallback (any engine's generate, the prefix recomputed per chunk) agrees.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_core.engines.streaming import ChunkedStream, StreamRequest, TokenStream
from hf_fsdp.rollout import TransformersRolloutEngine
from hf_fsdp.stream_decoder import LeanTokenStream
from hf_testing.tiny import build_tiny_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


def _prompts(count: int, vocab: int = 128) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (3 + i % 5,), generator=gen).tolist() for i in range(count)]


def _alone(engine: TransformersRolloutEngine, prompt: list[int], params: SamplingParams) -> Batch:
    ids = torch.tensor([prompt])
    prompt_batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return engine.generate(prompt_batch, params)


def _drain(stream: TokenStream, version: int = 0) -> list[StreamRequest]:
    done: list[StreamRequest] = []
    while stream.active:
        done += stream.advance(version)
    return done


def _engine(models: dict) -> TransformersRolloutEngine:
    return TransformersRolloutEngine({"model_path": str(models["qwen2_tied"]), "dtype": "float32"})


@pytest.mark.parametrize("kind", ["lean", "chunked"])
def test_requests_joining_and_leaving_decode_as_if_alone(models: dict, kind: str) -> None:
    engine = _engine(models)
    stream = engine.open_stream(4, 3) if kind == "lean" else ChunkedStream(engine, 3)
    assert isinstance(stream, LeanTokenStream if kind == "lean" else ChunkedStream)
    prompts = _prompts(7)
    lengths = [12, 5, 9, 12, 2, 7, 12]  # different ends, so rows leave and others join
    requests = [
        StreamRequest((0, i, 0), p, GREEDY.model_copy(update={"max_new_tokens": n}))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    stream.admit(requests[:3])
    done = stream.advance(0) + stream.advance(0)
    stream.admit(requests[3:])  # they join a decode two tokens in
    done += _drain(stream)
    assert sorted(r.key for r in done) == sorted(r.key for r in requests)
    for request in requests:
        alone = _alone(engine, request.prompt, request.params)
        length = int(alone["response_mask"].sum())
        assert request.tokens == alone["responses"][0, :length].tolist(), request.key
        torch.testing.assert_close(
            torch.tensor(request.log_probs),
            alone["rollout_log_probs"][0, :length],
            rtol=0,
            atol=1e-4,
        )
    if kind == "lean":
        assert isinstance(stream, LeanTokenStream) and stream.merges >= 2


def _token_log_probs(model_dir: Path | dict, sequence: list[int], weights: dict) -> torch.Tensor:
    """log softmax of raw logits (greedy) of each token of ``sequence`` after its prefix."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].float()
    targets = torch.tensor(sequence[1:])
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def test_an_update_mid_response_gives_each_token_its_own_versions_log_prob(
    models: dict, tmp_path: Path
) -> None:
    engine = _engine(models)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    other = build_tiny_model(tmp_path / "other", "qwen2", tie_word_embeddings=True, seed=7)
    new = dict(AutoModelForCausalLM.from_pretrained(other).state_dict())
    stream = engine.open_stream(4, 3)
    prompts = _prompts(4)
    requests = [StreamRequest((0, i, 0), p, GREEDY) for i, p in enumerate(prompts)]
    stream.admit(requests)
    for _ in range(5):
        assert not stream.advance(0)  # five tokens of version 0
    engine.load_weights((k, v) for k, v in new.items() if k != "lm_head.weight")
    engine.finish_weight_sync()
    stream.weights_changed()
    done = _drain(stream, version=1)
    assert len(done) == 4
    assert any(len(r.tokens) > 6 for r in requests)
    for request in requests:
        tail = len(request.tokens) - 5  # the new weights may end a response early (EOS)
        assert request.versions == [0] * 5 + [1] * tail  # tokens of two versions
        sequence = request.prompt + request.tokens
        start = len(request.prompt) - 1  # the position predicting the first response token
        before = _token_log_probs(models["qwen2_tied"], sequence, old)[start:]
        after = _token_log_probs(models["qwen2_tied"], sequence, new)[start:]
        own = torch.where(torch.tensor(request.versions) == 0, before, after)
        got = torch.tensor(request.log_probs)
        torch.testing.assert_close(got, own, rtol=0, atol=1e-4)
        if tail:
            assert (got[5:] - before[5:]).abs().max() > 1e-3  # the update did change them
