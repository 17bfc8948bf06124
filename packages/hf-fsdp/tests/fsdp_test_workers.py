"""A test worker wrapping the FSDP and HF engines, plus losses and batches the tests share.

Importable by the Ray worker processes (the tests folder is put on their PYTHONPATH), so loss
functions are passed by name rather than pickled from a test module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_core.protocols import register
from hf_core.worker import Worker

# ----------------------------------------------------------------------------- losses


def policy_loss(outputs: Mapping[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict]:
    """PPO clipped objective + entropy bonus, token mean over the *global* batch."""
    mask = mb["response_mask"].float()
    ratio = torch.exp(outputs["log_probs"] - mb["old_log_probs"])
    adv = mb["advantages"]
    pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    per_token = pg - 0.01 * outputs["entropy"]
    scale = mb.meta["dp_size"] / mb.meta["global_response_tokens"]
    loss = (per_token * mask).sum() * scale
    return loss, {"pg_loss": float((pg.detach() * mask).sum() / mask.sum().clamp(min=1))}


def value_loss(outputs: Mapping[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict]:
    """Squared error, mean over each sequence's tokens, then sample mean over the global batch."""
    mask = mb["response_mask"].float()
    err = (outputs["values"] - mb["returns"]) ** 2
    per_sample = (err * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    loss = per_sample.sum() * mb.meta["dp_size"] / mb.meta["global_batch_size"]
    return loss, {"vf_loss": float(per_sample.detach().mean())}


def score_loss(outputs: Mapping[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict]:
    """Regression of the sequence score onto ``targets`` (reward-model style)."""
    err = (outputs["scores"] - mb["targets"]) ** 2
    return err.sum() * mb.meta["dp_size"] / mb.meta["global_batch_size"], {}


LOSSES = {"policy": policy_loss, "value": value_loss, "score": score_loss}


# ---------------------------------------------------------------------------- batches


def rollout_batch(
    batch_size: int,
    prompt_len: int,
    response_len: int,
    vocab_size: int,
    seed: int,
    pad_id: int = 0,
    first_id: int = 3,
) -> Batch:
    """Left-padded prompts + right-padded responses with uneven lengths, and RL targets.

    Real tokens are never ``pad_id``, so HF's own pad-based pooling finds the same last
    token as the attention mask.
    """
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(first_id, vocab_size, (batch_size, prompt_len), generator=gen)
    responses = torch.randint(first_id, vocab_size, (batch_size, response_len), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    response_mask = torch.ones_like(responses)
    for i in range(batch_size):
        left = int(torch.randint(0, prompt_len - 1, (1,), generator=gen))
        kept = int(torch.randint(1, response_len + 1, (1,), generator=gen))
        prompt_mask[i, :left] = 0
        response_mask[i, kept:] = 0
    prompts = prompts.masked_fill(prompt_mask == 0, pad_id)
    responses = responses.masked_fill(response_mask == 0, pad_id)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask,
            "old_log_probs": -4.0 + 0.3 * torch.randn(batch_size, response_len, generator=gen),
            "advantages": torch.randn(batch_size, response_len, generator=gen),
            "returns": torch.randn(batch_size, response_len, generator=gen),
            "targets": torch.randn(batch_size, generator=gen),
        }
    )


# ----------------------------------------------------------------------------- worker


class EngineWorker(Worker):
    """Hosts named FSDP training engines and HF rollout engines on each rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)  # two ranks share two cores
        self.engines: dict[str, Any] = {}
        self.rollouts: dict[str, Any] = {}

    @register("ONE_TO_ALL")
    def build(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        from hf_fsdp.engine import FSDPEngine

        engine = FSDPEngine(config)
        self.engines[name] = engine
        report = engine.load_report
        return {"initialized": report.initialized, "unused": report.unused}

    @register("ONE_TO_ALL")
    def build_rollout(self, name: str, config: dict[str, Any]) -> None:
        from hf_fsdp.rollout import HFRolloutEngine

        self.rollouts[name] = HFRolloutEngine(config)

    @register("ONE_TO_ALL")
    def drop(self, name: str) -> None:
        self.engines.pop(name, None)
        self.rollouts.pop(name, None)

    @register("DP_PROTO")
    def log_probs(self, batch: Batch, name: str, temperature: float = 1.0) -> Batch:
        return self.engines[name].compute_log_probs(batch, temperature=temperature)

    @register("DP_PROTO")
    def values(self, batch: Batch, name: str) -> Batch:
        return self.engines[name].compute_values(batch)

    @register("DP_PROTO")
    def scores(self, batch: Batch, name: str) -> Batch:
        return self.engines[name].compute_scores(batch)

    @register("DP_PROTO")
    def train(self, batch: Batch, name: str, loss: str) -> dict[str, float]:
        return self.engines[name].train_step(batch, LOSSES[loss])

    @register("ONE_TO_ALL")
    def weights(self, name: str) -> dict[str, torch.Tensor] | None:
        """Full canonical weights (rank 0 returns them; every rank takes part)."""
        stream = self.engines[name].export_weights(1 << 20)
        out = {n: t.clone() for bucket in stream for n, t in bucket}
        return out if self.rank == 0 else None

    @register("ONE_TO_ALL")
    def sync(self, name: str, rollout: str, bucket_bytes: int) -> dict[str, int]:
        """Stream the engine's weights into the colocated rollout engine (hybrid mode)."""
        target = self.rollouts[rollout]
        buckets = tensors = largest = 0
        for bucket in self.engines[name].export_weights(bucket_bytes):
            target.load_weights(bucket)
            buckets += 1
            tensors += len(bucket)
            largest = max(largest, sum(t.numel() * t.element_size() for _, t in bucket))
        target.finish_weight_sync()
        return {"buckets": buckets, "tensors": tensors, "largest_bucket": largest}

    @register("DP_PROTO")
    def generate(self, batch: Batch, rollout: str, params: dict[str, Any]) -> Batch:
        return self.rollouts[rollout].generate(batch, SamplingParams(**params))

    @register("ONE_TO_ALL")
    def save(self, name: str, path: str) -> None:
        self.engines[name].save_checkpoint(path)

    @register("ONE_TO_ALL")
    def load(self, name: str, path: str) -> int:
        self.engines[name].load_checkpoint(path)
        return self.engines[name].step

    @register("ONE_TO_ALL")
    def export_hf(self, name: str, path: str, tokenizer: str | None = None) -> str:
        return str(self.engines[name].export_hf(path, tokenizer=tokenizer))

    @register("ONE_TO_ALL")
    def rand(self) -> list[float]:
        return torch.rand(3).tolist()
