"""What rollout engines share between core's rectangular batches and their decoders.

Prompts arrive left-padded (``input_ids`` + ``attention_mask``) and responses leave
right-padded to ``max_new_tokens`` (so batches from different ranks concatenate).  Engines
that decode token by token collect their steps in :class:`ResponseSteps`; engines whose
library takes and returns ragged token lists use :func:`strip_left_padding` and
:func:`pack_responses`.  Either way the result goes through
:func:`~hf_core.engines.rollout.assemble_rollout`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_core.batch import Batch
from hf_core.engines.rollout import PROMPT_KEYS, SamplingParams


def expand_prompts(prompts: Batch, params: SamplingParams) -> Batch:
    """The prompt batch with each row repeated ``params.n`` times (consecutive rows), after
    checking it has the keys every rollout engine reads."""
    missing = [k for k in PROMPT_KEYS if k not in prompts]
    if missing:
        raise KeyError(f"generate needs {missing}; the prompt batch has {sorted(prompts)}")
    return prompts.repeat_interleave(params.n) if params.n > 1 else prompts


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real prompt tokens (those with ``attention_mask == 1``), in order."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} differ in shape"
        )
    prompts = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.bool().tolist(), strict=True):
        kept = [token for token, keep in zip(ids, mask, strict=True) if keep]
        if not kept:
            raise ValueError("a prompt has no tokens (its attention_mask is all zero)")
        prompts.append(kept)
    return prompts


def left_padded(sequences: list[list[int]], pad_token_id: int, min_width: int = 0) -> Batch:
    """``input_ids`` / ``attention_mask`` of token sequences, left-padded to the longest (or to
    ``min_width`` if that is wider)."""
    width = max(min_width, *(len(s) for s in sequences))
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return Batch({"input_ids": ids, "attention_mask": mask})


def pack_responses(
    tokens: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    max_new_tokens: int,
    pad_token_id: int,
    dtype: torch.dtype,
    source: str = "the rollout engine",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``responses``, ``rollout_log_probs`` and ``response_mask`` from ragged rows, right-padded.

    The mask is 1 for every generated token, the stop token included, matching the HF
    rollout engine.  ``source`` names the library in errors.
    """
    rows = len(tokens)
    responses = torch.full((rows, max_new_tokens), pad_token_id, dtype=dtype)
    packed_log_probs = torch.zeros(rows, max_new_tokens, dtype=torch.float32)
    mask = torch.zeros(rows, max_new_tokens, dtype=torch.long)
    for row, (row_tokens, row_log_probs) in enumerate(zip(tokens, log_probs, strict=True)):
        length = len(row_tokens)
        if length > max_new_tokens:
            raise RuntimeError(f"{source} returned {length} tokens, asked for {max_new_tokens}")
        if length:
            responses[row, :length] = torch.tensor(list(row_tokens), dtype=dtype)
            packed_log_probs[row, :length] = torch.tensor(list(row_log_probs))
            mask[row, :length] = 1
    return responses, packed_log_probs, mask


class ResponseSteps:
    """The tokens a token-by-token decoder picks, step by step, for a batch of rows.

    A row is finished after it produced a stop token; from then on it gets ``pad_token_id``,
    log-prob 0 and mask 0, so the stop token itself is the last masked-in token.
    """

    def __init__(
        self,
        rows: int,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
        device: torch.device | None = None,
    ) -> None:
        self.pad_token_id = pad_token_id
        self.stop_ids = torch.tensor(list(stop_token_ids), dtype=torch.long, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self._tokens: list[torch.Tensor] = []
        self._log_probs: list[torch.Tensor] = []
        self._mask: list[torch.Tensor] = []

    def add(
        self, tokens: torch.Tensor, log_probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record one step; returns the tokens as recorded (pad for finished rows) and which
        rows were still alive at this step."""
        alive = ~self.finished
        tokens = torch.where(alive, tokens, self.pad_token_id)
        self._tokens.append(tokens)
        self._log_probs.append(torch.where(alive, log_probs, 0.0))
        self._mask.append(alive.long())
        self.finished = self.finished | torch.isin(tokens, self.stop_ids.to(tokens.dtype))
        return tokens, alive

    @property
    def done(self) -> bool:
        """Every row has stopped."""
        return bool(self.finished.all())

    def tensors(self, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``responses``, ``rollout_log_probs`` (float32) and ``response_mask``, right-padded
        to ``max_new_tokens`` columns."""
        pad = max_new_tokens - len(self._tokens)
        responses = torch.stack(self._tokens, dim=1)
        log_probs = torch.stack(self._log_probs, dim=1).float()
        response_mask = torch.stack(self._mask, dim=1)
        if pad:
            responses = torch.nn.functional.pad(responses, (0, pad), value=self.pad_token_id)
            log_probs = torch.nn.functional.pad(log_probs, (0, pad), value=0.0)
            response_mask = torch.nn.functional.pad(response_mask, (0, pad), value=0)
        return responses, log_probs, response_mask
