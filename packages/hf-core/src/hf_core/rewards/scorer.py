"""Scoring a batch of generated responses with a rule-based reward function.

:class:`RuleReward` decodes each response (the ``responses`` token ids where ``response_mask``
is 1, special tokens skipped), calls the batched reward function once with the batch's
``ground_truth`` and every other non-tensor as ``extras``, checks the result (one finite float
per sample) and returns a float32 tensor ``[B]``.

When the batched call raises, each sample is retried alone to find the one that fails, and the
error names the function, the sample's index and a short repr of its response and ground truth.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hf_core.batch import Batch
from hf_core.errors import HybridFlowError
from hf_core.rewards.registry import RewardFunction, get_reward_function

_REPR_LIMIT = 80


class RewardFunctionError(HybridFlowError, RuntimeError):
    """A reward function raised or returned something other than one finite float a sample.

    A :class:`~hf_core.errors.HybridFlowError`: the user's function is at fault, so the CLI
    reports it as a bad input (exit code 2) rather than a crash."""


def _short(value: Any, limit: int = _REPR_LIMIT) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RuleReward:
    """A rule-based reward function bound to a tokenizer: ``Batch -> float tensor [B]``.

    Args:
        fn: a registered name, a ``"package.module:function"`` path, a batched callable or a
            :class:`RewardFunction`.
        tokenizer: decodes response ids (``batch_decode(ids, skip_special_tokens=True)``).
        response_key: the batch key with response token ids [B, R] (right-padded).
        mask_key: the key with the response mask [B, R]; without it every token is decoded
            (padding is then dropped only if the pad token is a special token).
    """

    def __init__(
        self,
        fn: str | Callable[..., Any] | RewardFunction,
        tokenizer: Any = None,
        *,
        response_key: str = "responses",
        mask_key: str = "response_mask",
    ) -> None:
        self.function = get_reward_function(fn)
        self.tokenizer = tokenizer
        self.response_key = response_key
        self.mask_key = mask_key

    @property
    def name(self) -> str:
        return self.function.name

    # --------------------------------------------------------------- decoding
    def decode(self, batch: Batch) -> list[str]:
        """The response texts of ``batch`` (masked tokens dropped, special tokens skipped)."""
        if self.tokenizer is None:
            raise RewardFunctionError(f"reward {self.name!r}: decoding responses needs a tokenizer")
        ids = batch[self.response_key]
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            raise RewardFunctionError(
                f"reward {self.name!r}: batch key {self.response_key!r} must be a [B, R] tensor"
            )
        ids = ids.cpu()
        if self.mask_key in batch:
            mask = batch[self.mask_key].cpu().bool()
            rows = [row[m].tolist() for row, m in zip(ids, mask, strict=True)]
        else:
            rows = ids.tolist()
        return list(self.tokenizer.batch_decode(rows, skip_special_tokens=True))

    # ---------------------------------------------------------------- scoring
    def score_texts(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any] | None = None,
        extras: dict[str, Sequence[Any]] | None = None,
    ) -> torch.Tensor:
        """Call the function on decoded texts, validate, return float32 scores [B]."""
        responses = list(responses)
        size = len(responses)
        truths = [None] * size if ground_truths is None else list(ground_truths)
        extra_lists = {k: list(v) for k, v in (extras or {}).items()}
        if len(truths) != size:
            raise RewardFunctionError(
                f"reward {self.name!r}: {len(truths)} ground truths for {size} responses"
            )
        for key, values in extra_lists.items():
            if len(values) != size:
                raise RewardFunctionError(
                    f"reward {self.name!r}: extra {key!r} has {len(values)} values for "
                    f"{size} responses"
                )
        try:
            out = self.function(responses, truths, extra_lists)
        except Exception as batch_error:
            self._find_failing_sample(responses, truths, extra_lists, batch_error)
            raise  # unreachable: _find_failing_sample always raises
        return torch.tensor(self._validate(out, responses, truths), dtype=torch.float32)

    def _find_failing_sample(
        self,
        responses: list[str],
        truths: list[Any],
        extras: dict[str, list[Any]],
        batch_error: Exception,
    ) -> None:
        for i, (response, truth) in enumerate(zip(responses, truths, strict=True)):
            try:
                self.function([response], [truth], {k: [v[i]] for k, v in extras.items()})
            except Exception as e:
                raise RewardFunctionError(
                    f"reward function {self.name!r} raised on sample {i} of {len(responses)} "
                    f"(response={_short(response)}, ground_truth={_short(truth)}): "
                    f"{type(e).__name__}: {e}"
                ) from e
        raise RewardFunctionError(
            f"reward function {self.name!r} raised on the batch of {len(responses)} but on no "
            f"single sample: {type(batch_error).__name__}: {batch_error}"
        ) from batch_error

    def _validate(self, out: Any, responses: list[str], truths: list[Any]) -> list[float]:
        if isinstance(out, torch.Tensor | np.ndarray):
            out = out.tolist()
        if isinstance(out, str | bytes | dict) or not hasattr(out, "__len__"):
            raise RewardFunctionError(
                f"reward function {self.name!r} must return a list of floats, "
                f"got {type(out).__name__}"
            )
        if len(out) != len(responses):
            raise RewardFunctionError(
                f"reward function {self.name!r} returned {len(out)} scores for "
                f"{len(responses)} responses"
            )
        scores = []
        for i, value in enumerate(out):
            try:
                score = float(value)
            except (TypeError, ValueError):
                score = math.nan
                bad = f"a {type(value).__name__} ({_short(value)}), not a number"
            else:
                bad = f"{score}, not a finite number"
            if isinstance(value, str | bytes) or not math.isfinite(score):
                raise RewardFunctionError(
                    f"reward function {self.name!r} returned {bad} for sample {i} "
                    f"(response={_short(responses[i])}, ground_truth={_short(truths[i])})"
                )
            scores.append(score)
        return scores

    def score(self, batch: Batch) -> tuple[torch.Tensor, list[str]]:
        """Scores [B] (float32, on the responses' device) and the decoded responses."""
        texts = self.decode(batch)
        size = len(texts)
        truths = list(batch["ground_truth"]) if "ground_truth" in batch.non_tensors else None
        extras: dict[str, Sequence[Any]] = {
            k: list(v) for k, v in batch.non_tensors.items() if k != "ground_truth"
        }
        scores = self.score_texts(texts, truths if truths is not None else [None] * size, extras)
        return scores.to(batch[self.response_key].device), texts

    def __call__(self, batch: Batch) -> torch.Tensor:
        return self.score(batch)[0]

    def __repr__(self) -> str:
        return f"RuleReward({self.name!r})"
