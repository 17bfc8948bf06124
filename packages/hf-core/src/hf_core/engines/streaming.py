"""Token streams: generation that requests can join and leave while it runs, and that survives
a weight update between two tokens (streaming rollouts with partial rollouts).

A :class:`StreamRequest` is one sample being generated.  A :class:`TokenStream` decodes every
request it holds by at least one token per :meth:`~TokenStream.advance` and returns the ones
that ended; new requests join with :meth:`~TokenStream.admit`.  Between two ``advance`` calls
the engine's weights may change (:meth:`~TokenStream.weights_changed`): every token a request
gets after that carries the new policy version, and its log-prob is the new weights' -- the
stream recomputes the prefix (prompt and the response so far) under the new weights before
the next token, so cached keys and values of the old weights never mix into a new token.

Engines with a token-level decoder implement :class:`OpensTokenStream` (the transformers engine:
its KV cache is kept between updates).  Any other engine gets :class:`ChunkedStream`, which calls
the engine's ``generate`` on each request's prompt plus its response so far for up to
``chunk_tokens`` more tokens: the prefix is recomputed at every chunk (engines with a prefix
cache, like vLLM, reuse it while the weights are unchanged), and an update waits for the
running chunk to end.

Routing replay (``SamplingParams.routed_experts`` on a mixture-of-experts model): a request
keeps, per position it fed through the model (prompt tokens and response tokens so far), the
top-k experts of every MoE layer (:attr:`StreamRequest.routed`), and :func:`responses_batch`
lays them out as the rollout engines' ``routed_experts`` key.  A position's experts are those
of the *first* forward that fed it; a prefix fed again (every chunk of a
:class:`ChunkedStream`, the re-prefill after a weight update) does not overwrite them.  See
:meth:`StreamRequest.record_routing` for why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from hf_core.batch import Batch
from hf_core.engines.decoding import left_padded
from hf_core.engines.rollout import SamplingParams
from hf_core.engines.routed_experts import ROUTED_EXPERTS_KEY, keep_first_routing, routing_batch


@dataclass
class StreamRequest:
    """One sample in generation: the ``sample``-th of its prompt's ``n``."""

    key: tuple[int, int, int]
    """(epoch, the prompt's ``sample_index``, which of its ``n`` samples)."""
    prompt: list[int]
    params: SamplingParams
    """The sampling parameters of its submission (``n`` and ``seed`` ignored mid-stream)."""
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Per response token: the policy version of the weights that sampled it."""
    finished: bool = False
    routed: torch.Tensor | None = None
    """With ``params.routed_experts`` on an MoE model: ``[positions, moe layers, k]`` expert
    ids of the positions fed so far, from position 0 of the prompt on (prompt tokens, then
    response tokens; a response's last token is never fed, so it has none).  None before the
    first record.  Kept by :meth:`record_routing`."""

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.tokens)

    @property
    def routed_positions(self) -> int:
        """Positions with recorded experts (a run from position 0)."""
        return 0 if self.routed is None else int(self.routed.shape[0])

    def record_routing(self, fed: torch.Tensor) -> None:
        """Keep the experts of positions fed for the first time
        (:func:`~hf_core.engines.routed_experts.keep_first_routing`, which says why the first
        forward's): ``fed`` is one forward's ``[positions, moe layers, k]`` routing of this
        request's positions ``0, 1, ...`` (prompt, then response)."""
        self.routed = keep_first_routing(self.routed, fed, f"request {self.key}")

    def extend(self, tokens: list[int], log_probs: list[float], version: int) -> None:
        """Record tokens sampled by weights of ``version`` (at most :attr:`remaining`)."""
        take = min(len(tokens), self.remaining)
        self.tokens += tokens[:take]
        self.log_probs += log_probs[:take]
        self.versions += [version] * take
        if self.remaining == 0:
            self.finished = True


class TokenStream(Protocol):
    """A running generation (see the module docstring)."""

    @property
    def active(self) -> int:
        """Requests decoding now."""
        ...

    def admit(self, requests: list[StreamRequest]) -> None:
        """Start decoding ``requests`` (fresh, or with a response begun under older weights)."""
        ...

    def advance(self, version: int) -> list[StreamRequest]:
        """Decode at least one token of every active request with the weights of ``version``;
        the requests that ended (stop token or ``max_new_tokens``), removed from the stream."""
        ...

    def weights_changed(self) -> None:
        """The engine's weights were replaced: state computed with the old ones is stale."""
        ...


@runtime_checkable
class OpensTokenStream(Protocol):
    """A rollout engine with its own token-level stream."""

    def open_stream(self, capacity: int, chunk_tokens: int) -> TokenStream:
        """A stream decoding up to ``capacity`` requests at once (``chunk_tokens``: for a
        :class:`ChunkedStream`, where the engine falls back to one)."""
        ...


class GeneratesBatches(Protocol):
    """Anything with a rollout engine's ``generate`` (an engine, the agent loop)."""

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch: ...


def stop_ids(engine: object, params: SamplingParams) -> set[int]:
    """The tokens that end a response: the request's stop ids and the engine's EOS ids."""
    return {*params.stop_token_ids, *getattr(engine, "eos_token_ids", ())}


class ChunkedStream:
    """A token stream over any engine's ``generate``: up to ``chunk_tokens`` tokens per
    advance, the prefix recomputed each time (see the module docstring)."""

    def __init__(self, engine: GeneratesBatches, chunk_tokens: int, pad_token_id: int = 0) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.engine, self.chunk_tokens = engine, chunk_tokens
        self.pad_token_id = int(getattr(engine, "pad_token_id", pad_token_id) or 0)
        self._requests: list[StreamRequest] = []

    @property
    def active(self) -> int:
        return len(self._requests)

    def admit(self, requests: list[StreamRequest]) -> None:
        self._requests += requests

    def weights_changed(self) -> None:
        """Nothing is cached between chunks: the next chunk runs on the new weights."""

    def advance(self, version: int) -> list[StreamRequest]:
        by_params: dict[SamplingParams, list[StreamRequest]] = {}
        for request in self._requests:
            by_params.setdefault(request.params, []).append(request)
        for params, requests in by_params.items():
            self._chunk(requests, params, version)
        done = [r for r in self._requests if r.finished]
        self._requests = [r for r in self._requests if not r.finished]
        return done

    def _chunk(self, requests: list[StreamRequest], params: SamplingParams, version: int) -> None:
        budget = min(self.chunk_tokens, max(r.remaining for r in requests))
        call = params.model_copy(update={"n": 1, "seed": None, "max_new_tokens": budget})
        prompts = left_padded([r.prompt + r.tokens for r in requests], self.pad_token_id)
        out = self.engine.generate(prompts, call)
        stops = stop_ids(self.engine, params)
        replay = params.routed_experts and ROUTED_EXPERTS_KEY in out  # dense models: none
        routed = out[ROUTED_EXPERTS_KEY] if replay else None
        width = prompts["input_ids"].shape[1]  # columns as input_ids: prefixes left-padded
        for row, request in enumerate(requests):
            length = int(out["response_mask"][row].sum())
            tokens = out["responses"][row, :length].tolist()
            prefix = len(request.prompt) + len(request.tokens)
            request.extend(tokens, out["rollout_log_probs"][row, :length].tolist(), version)
            if routed is not None:
                kept = len(request.tokens) + len(request.prompt) - prefix
                fed = routed[row, width - prefix : width + kept]
                request.record_routing(fed)
            if length < budget or (tokens and tokens[-1] in stops):
                request.finished = True


def responses_batch(requests: list[StreamRequest], pad_token_id: int) -> Batch:
    """The rollout engines' output keys for finished requests (prompts left-padded to the
    longest, responses right-padded to the longest ``max_new_tokens``), plus
    ``token_versions`` (per response token, -1 on padding) and ``interrupted`` (whether a
    weight update reached the sample mid-generation).  When the requests recorded routing
    (:attr:`StreamRequest.routed`), ``routed_experts`` too: ``[rows, prompt + response
    columns, moe layers, k]`` laid out like ``input_ids``, the unrecorded marker where nothing
    was fed (padding, each response's last token)."""
    from hf_core.engines.rollout import assemble_rollout

    width = max(r.params.max_new_tokens for r in requests)
    rows = len(requests)
    # one tensor per key from the flat lists, scattered row-major under the mask: a whole
    # step's requests cost a few tensor builds, not three per request
    lengths = torch.tensor([len(r.tokens) for r in requests], dtype=torch.long)
    real = torch.arange(width)[None, :] < lengths[:, None]
    mask = real.long()
    responses = torch.full((rows, width), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((rows, width), dtype=torch.float32)
    versions = torch.full((rows, width), -1, dtype=torch.long)
    responses[real] = torch.tensor([t for r in requests for t in r.tokens], dtype=torch.long)
    log_probs[real] = torch.tensor([p for r in requests for p in r.log_probs], dtype=torch.float32)
    versions[real] = torch.tensor([v for r in requests for v in r.versions], dtype=torch.long)
    prompts = left_padded([r.prompt for r in requests], pad_token_id)
    temperature = requests[0].params.temperature
    out = assemble_rollout(prompts, responses, mask, log_probs, temperature)
    out["token_versions"] = versions
    spans = [len(set(r.versions)) > 1 for r in requests]
    out["interrupted"] = torch.tensor(spans, dtype=torch.bool)
    recorded = [(r.routed, len(r.prompt), len(r.tokens)) for r in requests]
    routed = routing_batch(recorded, prompts["input_ids"].shape[1], width)
    if routed is not None:
        out[ROUTED_EXPERTS_KEY] = routed
    return out
