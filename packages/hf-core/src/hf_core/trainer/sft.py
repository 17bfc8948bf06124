"""Supervised fine-tuning (``trainer: sft``): the actor learns chat or prompt/completion
examples, the loss on the assistant's tokens only.

The dataflow is one call per step: the batch (prompt + target as a rollout-shaped batch whose
``response_mask`` marks the assistant's tokens, :mod:`hf_core.data.chat_tokens`) goes to the
actor's :meth:`~hf_core.roles.ActorRolloutRefWorker.sft_step`, which runs the engine's train
step -- token-budget micro-batches, packing, LoRA, gradient accumulation over micro-batches
and data-parallel ranks all as in RL.  Validation is the token-mean negative log-likelihood
of ``data.val_files`` under the current weights.  The exported ``actor_hf`` folder is the
``model.path`` of a later RL (or DPO) recipe.
"""

from __future__ import annotations

import math
import time

import torch

from hf_core.data.chat_tokens import SFTDataset
from hf_core.data.loader import CollatingDataset
from hf_core.trainer.one_model import OneModelLoop


def nll_sums(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[negative log-likelihood summed over the masked tokens, their count]`` in float64,
    so batches add up to the exact token mean."""
    weights = mask.to(torch.float64)
    return torch.stack([-(log_probs.to(torch.float64) * weights).sum(), weights.sum()])


class SFTTrainer(OneModelLoop):
    role = "actor"
    headline = ("actor/sft_nll",)
    validation_headline = ("val/nll",)

    def _dataset(self, files: list[str]) -> CollatingDataset:
        return SFTDataset.from_files(files, self.tokenizer, max_length=self.config.sft.max_length)

    def _train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        batch = self._next_batch()
        rows = self._groups.actor.sft_step(batch)
        metrics = self._step_metrics(rows, "actor", batch, start)
        tokens = metrics.pop("actor/sft_tokens_sum")
        metrics["actor/sft_nll"] = metrics.pop("actor/sft_nll_sum") / max(tokens, 1.0)
        metrics["sft/target_tokens"] = tokens
        return metrics

    def validate(self) -> dict[str, float]:
        """Token-mean NLL (and its perplexity) of the held-out targets."""
        total = torch.zeros(2, dtype=torch.float64)
        for batch in self._val_batches():
            out = self._groups.actor.compute_log_probs(batch)
            total += nll_sums(out["old_log_probs"], batch["response_mask"])
        if total[1] == 0:
            return {}
        nll = float(total[0] / total[1])
        return {"val/nll": nll, "val/perplexity": math.exp(min(nll, 50.0))}
