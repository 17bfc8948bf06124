"""Continuous batching on the lean decoder: the transformers engine's token stream for streaming
rollouts (``hf_core.engines.streaming``).

Requests join a running decode and leave it when they end, so the rows decoded each step are
samples still under way, not a batch waiting for its longest response.  The KV cache is one
tensor per layer, ``[rows, columns, key/value, kv head, head_dim]``, with a shared write
column: every row's keys and values are contiguous and end at that column (a row's prefix is
placed right before it when the row joins), so a decode step is the lean decoder's ordinary
step over all rows, each row masking the columns before its own start.

A *merge* rebuilds the cache: rows that ended leave, waiting requests are prefilled (once per
group of identical prompts) and join, and the columns no row needs are trimmed.  It costs a
copy of the cache, so it runs when enough slots are free (an eighth of the capacity) or no
row is left, not at every finish; ended rows decode dummy tokens until then.

After a weight update every row's prefix (prompt and response so far) is prefilled again with
the new weights before the next token: cached keys and values of the old weights never reach a
new token, so each token's log-prob is exactly its own policy version's (the KV cache is
recomputed, not kept, across an update).

The lean decoder runs dense models only, so this stream has no routing to record
(``SamplingParams.routed_experts`` is a no-op for dense models); a mixture-of-experts model
streams through :class:`~hf_core.engines.streaming.ChunkedStream` over the engine's own
generation, which records each fed token's experts (``TransformersRolloutEngine.open_stream``).
"""

from __future__ import annotations

import time

import torch

from hf_core.engines import left_padded, select_tokens
from hf_core.engines.streaming import StreamRequest
from hf_fsdp.decoder import LlamaFamilyDecoder


class _Cache:
    """What :meth:`LlamaFamilyDecoder.forward` reads and writes: per-layer caches, the write
    column and rotary tables."""

    def __init__(
        self,
        cache: list[torch.Tensor],
        length: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        self.cache, self.length, self.cos, self.sin = cache, length, cos, sin


class LeanTokenStream:
    """A :class:`~hf_core.engines.streaming.TokenStream` on :class:`LlamaFamilyDecoder`."""

    def __init__(
        self,
        decoder: LlamaFamilyDecoder,
        capacity: int,
        stop_token_ids: list[int],
        pad_token_id: int,
        generator: torch.Generator,
        device: torch.device,
    ) -> None:
        self.decoder, self.capacity = decoder, capacity
        self.engine_stops = set(stop_token_ids)
        self.pad_token_id, self.generator, self.device = pad_token_id, generator, device
        self.rows: list[StreamRequest | None] = []
        """The request decoded in each cache row (None: it ended, waiting for a merge)."""
        self.waiting: list[StreamRequest] = []
        self.state: _Cache | None = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.positions = torch.zeros(0, dtype=torch.long)
        self.logits: torch.Tensor | None = None
        self.stale = False
        self.merge_at = max(1, capacity // 8)
        self.merges = 0
        self._recomputed_tokens = 0
        self._recompute_s = 0.0

    # ------------------------------------------------------------- the protocol
    @property
    def active(self) -> int:
        return sum(r is not None for r in self.rows) + len(self.waiting)

    def admit(self, requests: list[StreamRequest]) -> None:
        self.waiting += requests

    def weights_changed(self) -> None:
        self.stale = True

    @torch.no_grad()
    def advance(self, version: int) -> list[StreamRequest]:
        live_rows = [i for i, r in enumerate(self.rows) if r is not None]
        free = self.capacity - len(live_rows)
        if self.stale:
            self._rebuild()
        elif self.waiting and (not live_rows or free >= self.merge_at):
            self._merge(live_rows)
        elif live_rows and len(live_rows) <= len(self.rows) // 2:
            self._merge(live_rows)  # the tail: fewer rows make cheaper steps
        if self.logits is None or not self.rows:
            return []
        params = next(r for r in self.rows if r is not None).params
        tokens, log_probs = select_tokens(self.logits, params, self.generator)
        done: list[StreamRequest] = []
        token_list, logprob_list = tokens.tolist(), log_probs.tolist()
        for row, request in enumerate(self.rows):
            if request is None:
                continue
            token = token_list[row]
            request.extend([token], [logprob_list[row]], version)
            if token in self.engine_stops or token in request.params.stop_token_ids:
                request.finished = True
            if request.finished:
                done.append(request)
                self.rows[row] = None
        if any(r is not None for r in self.rows):
            self.logits = self._feed(tokens)
        else:
            self.rows, self.logits, self.state = [], None, None
        return done

    # ------------------------------------------------------------------ decoding
    def _feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step over every row (rows that ended decode a dummy token)."""
        state = self.state
        assert state is not None
        column = state.length
        self.valid[:, column] = True
        mask = self.valid[:, None, None, : column + 1]
        tokens = tokens.to(self.device)
        logits = self.decoder.forward(tokens[:, None], self.positions[:, None], state, mask)
        self.positions += 1
        return logits

    def _prefill(
        self, requests: list[StreamRequest], headroom: int
    ) -> tuple[_Cache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill the requests' prefixes (prompt and response so far) in a fresh cache with
        ``headroom`` free columns: the cache, its key validity, next positions and logits."""
        sequences = [r.prompt + r.tokens for r in requests]
        batch = left_padded(sequences, self.pad_token_id)
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device)
        session = self.decoder.open(ids, mask, headroom, _group_size(requests))
        logits = session.prefill()
        valid = session.keys_valid.clone()
        valid[:, ids.shape[1] :] = False
        cache = _Cache(session.cache, session.length, session.cos, session.sin)
        return cache, valid, mask.sum(-1), logits

    def _take_waiting(self, live: int) -> list[StreamRequest]:
        room = self.capacity - live
        joining, self.waiting = self.waiting[:room], self.waiting[room:]
        return joining

    def take_stats(self) -> dict[str, float]:
        """What the updates cost since the last call: prefix tokens prefilled again (responses
        under way recomputed on the new weights) and the seconds that took."""
        stats = {
            "stream/recomputed_tokens": float(self._recomputed_tokens),
            "stream/recompute_s": self._recompute_s,
        }
        self._recomputed_tokens, self._recompute_s = 0, 0.0
        return stats

    def _rebuild(self) -> None:
        """After a weight update: every row's prefix prefilled again with the new weights."""
        start = time.perf_counter()
        recomputing = any(r is not None for r in self.rows)
        self._rebuild_rows()
        if recomputing:  # else it only admitted new requests, as a merge would
            self._recompute_s += time.perf_counter() - start

    def _rebuild_rows(self) -> None:
        live = [r for r in self.rows if r is not None]
        self._recomputed_tokens += sum(len(r.prompt) + len(r.tokens) for r in live)
        requests = live + self._take_waiting(len(live))
        if not requests:
            self.rows, self.logits, self.state = [], None, None
        else:
            headroom = max(r.remaining for r in requests)
            self.state, self.valid, self.positions, self.logits = self._prefill(requests, headroom)
            self.rows = list[StreamRequest | None](requests)
        self.stale = False

    def _merge(self, live_rows: list[int]) -> None:
        """Rows that ended leave; waiting requests that fit are prefilled and join.  Kept
        rows' keys and values are copied, not recomputed; columns no row needs are trimmed."""
        joining = self._take_waiting(len(live_rows))
        kept = [self.rows[i] for i in live_rows]
        requests: list[StreamRequest] = [r for r in kept if r is not None] + joining
        self.merges += 1
        if not requests:
            self.rows, self.logits, self.state = [], None, None
            return
        headroom = max(r.remaining for r in requests)
        if not kept:
            self.state, self.valid, self.positions, self.logits = self._prefill(requests, headroom)
            self.rows = list[StreamRequest | None](requests)
            return
        old, index = self.state, torch.tensor(live_rows, device=self.device)
        assert old is not None and self.logits is not None
        span = int(self.positions[index].max())  # kept rows' columns end at old.length
        parts: list[tuple[_Cache, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if joining:
            parts.append(self._prefill(joining, 0))
        width = max([span] + [part[0].length for part in parts])
        columns = width + headroom
        rows = len(requests)
        layers = []
        for layer in old.cache:
            fresh = layer.new_zeros((rows, columns, *layer.shape[2:]))  # SDPA reads masked keys
            fresh[: len(kept), width - span : width] = layer[index, old.length - span : old.length]
            layers.append(fresh)
        valid = torch.zeros(rows, columns, dtype=torch.bool, device=self.device)
        valid[: len(kept), width - span : width] = self.valid[index, old.length - span : old.length]
        positions = [self.positions[index]]
        logits = [self.logits[index]]
        if parts:
            new, new_valid, new_positions, new_logits = parts[0]
            prompt = new.length
            for fresh, layer in zip(layers, new.cache, strict=True):
                fresh[len(kept) :, width - prompt : width] = layer[:, :prompt]
            valid[len(kept) :, width - prompt : width] = new_valid[:, :prompt]
            positions.append(new_positions)
            logits.append(new_logits)
        self.positions = torch.cat(positions)
        self.logits = torch.cat(logits)
        self.valid = valid
        cos, sin = self.decoder.rotary_tables(int(self.positions.max()) + headroom, self.device)
        self.state = _Cache(layers, width, cos, sin)
        self.rows = list[StreamRequest | None](requests)


def _group_size(requests: list[StreamRequest]) -> int:
    """``n`` when the requests come as whole groups of fresh samples of one prompt each (the
    session checks the rows really repeat), else 1."""
    n = requests[0].params.n
    if n <= 1 or len(requests) % n or any(r.tokens for r in requests):
        return 1
    return n
