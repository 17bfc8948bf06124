"""The rollout (generation) engine interface and sampling parameters."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field

from hf_core.engines.weights import NamedTensor

if TYPE_CHECKING:
    from hf_core.batch import Batch

PROMPT_KEYS = ("input_ids", "attention_mask")


class SamplingParams(BaseModel):
    """Backend-neutral sampling parameters; each rollout backend maps them to its own.

    ``temperature == 0`` means greedy decoding.  Log-probs returned by an engine are always of
    the distribution actually sampled from (logits divided by ``temperature``; raw logits when
    greedy), the same quantity a training engine computes at that temperature.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k")
    max_new_tokens: int = Field(64, ge=1)
    n: int = Field(1, ge=1, description="samples per prompt")
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    routed_experts: bool = Field(
        False,
        description="mixture-of-experts models: also return each fed token's top-k expert "
        "ids per MoE layer (batch key routed_experts, for routing replay; "
        "hf_core.engines.routed_experts); dense models ignore it",
    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RolloutEngine(ABC):
    """Generates responses and accepts weight updates in place.

    Batch keys in: ``input_ids`` (left-padded prompts) and ``attention_mask``.
    Batch keys out (each prompt repeated ``n`` times, consecutive): ``prompts``, ``responses``
    (right-padded), ``response_mask``, ``input_ids`` (prompt + response), ``attention_mask``,
    ``position_ids`` and ``rollout_log_probs`` (per response token).
    """

    compute_dtype: torch.dtype | None = None
    """The dtype the engine's weights and products are in, where the engine knows it
    (``None``: unknown).  A 16-bit one turns ``algorithm.rollout_is: auto`` on."""

    @abstractmethod
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample responses for a batch of tokenised prompts."""

    @abstractmethod
    def load_weights(self, bucket: Iterable[NamedTensor]) -> None:
        """Load one bucket of canonical tensors in place (partial updates are fine)."""

    def finish_weight_sync(self) -> None:
        """Called after the last bucket of a sync: flush caches that hold stale results."""

    def release_memory(self) -> int:
        """Free KV cache (and weights where supported) while training runs; returns the bytes
        freed (on a CPU-only run, where nothing is freed, the bytes it would free).
        Default: nothing, 0."""
        return 0

    def resume_memory(self) -> int:
        """Undo :meth:`release_memory` before the next generation; bytes brought back (or
        that would be). Default: nothing, 0."""
        return 0

    def sync_metrics(self) -> dict[str, float]:
        """Numbers of the last weight sync under ``weight_sync/`` keys (seconds, buckets,
        bytes), for the trainer's log.  Default: none measured."""
        return {}

    def close(self) -> None:
        """Release processes, process groups and memory the engine holds. Default: nothing."""


def assemble_rollout(
    prompts: Batch,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    temperature: float,
) -> Batch:
    """The output batch every rollout engine returns (see :class:`RolloutEngine`).

    ``prompts`` is the (already ``n``-times repeated) prompt batch; its other keys are kept.
    Responses are right-padded; ``position_ids`` count only attended tokens, as the training
    engines do, so log-probs recomputed there line up with ``rollout_log_probs``.
    """
    prompt_ids, prompt_mask = prompts["input_ids"], prompts["attention_mask"]
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    out = prompts.select(*[k for k in prompts.keys() if k not in ("position_ids", *PROMPT_KEYS)])
    out["prompts"] = prompt_ids
    out["responses"] = responses
    out["response_mask"] = response_mask.long()
    out["input_ids"] = torch.cat([prompt_ids, responses], dim=1)
    out["attention_mask"] = attention_mask
    out["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out["rollout_log_probs"] = log_probs.float()
    out.meta["temperature"] = temperature
    return out
