"""Test-worker scaffolding the backends' suites share: losses, rollout batches, a worker base.

Ray worker processes import these by module name, so a test passes a loss by its name in
:data:`LOSSES` rather than pickling a function from a test module.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hf_core.batch import Batch
from hf_core.protocols import WorkerMesh, register
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


def distill_top_k_loss(outputs: Mapping[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict]:
    """:func:`policy_loss` plus the top-k forward KL to the batch's teacher top-k
    (``teacher_top_k_ids`` / ``teacher_top_k_log_probs``), token mean over the global batch."""
    from hf_core.algorithms.distill_top_k import top_k_divergence
    from hf_core.engines.top_k import LOG_PROBS_AT_TEACHER_TOP_K, TEACHER_TOP_K_LOG_PROBS

    loss, metrics = policy_loss(outputs, mb)
    mask = mb["response_mask"].float()
    divergence = top_k_divergence(
        outputs[LOG_PROBS_AT_TEACHER_TOP_K], mb[TEACHER_TOP_K_LOG_PROBS], loss="forward_kl_topk"
    )
    scale = mb.meta["dp_size"] / mb.meta["global_response_tokens"]
    return loss + (divergence * mask).sum() * scale, metrics


def with_teacher_top_k(batch: Batch, vocab_size: int, k: int, seed: int) -> Batch:
    """``batch`` plus a made-up teacher's top-k per response position: ``k`` distinct ids and
    their log-probs under a random distribution (what ``distill_top_k`` trains toward)."""
    from hf_core.engines.top_k import TEACHER_TOP_K_IDS, TEACHER_TOP_K_LOG_PROBS

    gen = torch.Generator().manual_seed(seed)
    rows, width = batch["responses"].shape
    logits = torch.randn(rows, width, vocab_size, generator=gen) * 2
    top = torch.log_softmax(logits, -1).topk(k, dim=-1)
    out = batch.select(*batch.keys())
    out.meta.update(batch.meta)
    out[TEACHER_TOP_K_IDS], out[TEACHER_TOP_K_LOG_PROBS] = top.indices, top.values
    return out


LOSSES = {
    "policy": policy_loss,
    "value": value_loss,
    "score": score_loss,
    "distill_top_k": distill_top_k_loss,
}


# ---------------------------------------------------------------------------- batches


def rollout_batch(
    batch_size: int,
    prompt_len: int,
    response_len: int,
    vocab_size: int,
    seed: int,
    pad_id: int = 0,
    first_id: int = 3,
    group_size: int = 1,
) -> Batch:
    """Left-padded prompts + right-padded responses with uneven lengths, and RL targets.

    Real tokens are never ``pad_id``, so transformers' own pad-based choice of the scored
    token finds the same last token as the attention mask.  ``group_size`` consecutive rows
    share one prompt (GRPO's samples of a prompt).
    """
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(first_id, vocab_size, (batch_size, prompt_len), generator=gen)
    responses = torch.randint(first_id, vocab_size, (batch_size, response_len), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    response_mask = torch.ones_like(responses)
    for i in range(batch_size):
        left = int(torch.randint(0, prompt_len - 1, (1,), generator=gen))
        kept = int(torch.randint(1, response_len + 1, (1,), generator=gen))
        if i % group_size:  # a later sample of the group: the group's prompt
            prompts[i], left = prompts[i - 1], int((prompt_mask[i - 1] == 0).sum())
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


# ----------------------------------------------------------------------------- workers


@functools.cache
def engine_worker_base(data_protocol: str) -> type[Worker]:
    """A worker base hosting named training engines (``self.engines``) and rollout engines
    (``self.rollouts``) on each rank, with the calls every backend's tests make.

    ``data_protocol`` dispatches the batch calls: ``"DP_PROTO"`` for pure data parallelism,
    ``"3D_PROTO"`` for engines that report a TP/PP mesh.  Subclasses add ``build`` and the
    backend's own calls; ``weight_bucket_bytes`` sizes the buckets :meth:`weights` streams.
    """

    class EngineWorkerBase(Worker):
        weight_bucket_bytes = 1 << 20

        def __init__(self) -> None:
            super().__init__()
            torch.set_num_threads(1)  # the test ranks share the machine's few cores
            self.engines: dict[str, Any] = {}
            self.rollouts: dict[str, Any] = {}

        @register("ONE_TO_ALL")
        def drop(self, name: str) -> None:
            self.engines.pop(name, None)
            self.rollouts.pop(name, None)

        @register(data_protocol)
        def log_probs(
            self, batch: Batch, name: str, temperature: float = 1.0, top_k: int = 0
        ) -> Batch:
            engine = self.engines[name]
            if top_k:
                return engine.compute_log_probs(batch, temperature=temperature, top_k=top_k)
            return engine.compute_log_probs(batch, temperature=temperature)

        @register(data_protocol)
        def values(self, batch: Batch, name: str) -> Batch:
            return self.engines[name].compute_values(batch)

        @register(data_protocol)
        def train(self, batch: Batch, name: str, loss: str) -> dict[str, float]:
            return self.engines[name].train_step(batch, LOSSES[loss])

        @register("ONE_TO_ALL")
        def weights(self, name: str) -> dict[str, torch.Tensor] | None:
            """Full canonical weights (rank 0 returns them; every rank takes part)."""
            stream = self.engines[name].export_weights(self.weight_bucket_bytes)
            out = {n: t.clone() for bucket in stream for n, t in bucket}
            return out if self.rank == 0 else None

        @register("ONE_TO_ALL")
        def save(self, name: str, path: str) -> None:
            self.engines[name].save_checkpoint(path)

        @register("ONE_TO_ALL")
        def load(self, name: str, path: str) -> int:
            self.engines[name].load_checkpoint(path)
            return self.engines[name].step

        @register("ONE_TO_ALL")
        def rand(self) -> list[float]:
            return torch.rand(3).tolist()

    EngineWorkerBase.__qualname__ = EngineWorkerBase.__name__ = f"EngineWorkerBase_{data_protocol}"
    return EngineWorkerBase


def with_generation_rank(mesh: WorkerMesh, layout: Any) -> WorkerMesh:
    """``mesh`` plus the generation coordinates of a rollout engine's ``layout`` (anything
    with ``dp_rank``, ``dp_size``, ``tp_rank``, ``tp_size``): what core's actor reports."""
    axes = ("dp_rank", "dp_size", "tp_rank", "tp_size")
    return dataclasses.replace(mesh, **{f"gen_{a}": getattr(layout, a) for a in axes})


# ------------------------------------------------------------------------ checkpoints


@dataclass
class TrainedRun:
    """What a run left after its last training step: metrics, every rank's RNG draw, and
    rank 0's full weights."""

    metrics: list[dict[str, float]]
    rand: list[list[float]]
    weights: dict[str, torch.Tensor]


def resumed_runs(
    group: Any, config: dict[str, Any], first: Batch, second: Batch, ckpt: str
) -> tuple[TrainedRun, TrainedRun, list[int]]:
    """Run a trains on ``first``, saves ``ckpt``, trains on ``second``; run b, a fresh engine
    built from the same HF folder, loads ``ckpt`` and trains on ``second``.

    Returns both runs and the steps each rank's ``load`` reported; a resume that restores
    everything (weights, optimizer, schedule, RNG) makes the runs identical.
    """

    def after_second_step(name: str) -> TrainedRun:
        rand = group.rand()
        metrics = group.train(second, name=name, loss="policy")
        return TrainedRun(metrics, rand, group.weights(name)[0])

    group.build("run_a", config)
    group.train(first, name="run_a", loss="policy")
    group.save("run_a", ckpt)
    run_a = after_second_step("run_a")
    group.drop("run_a")

    group.build("run_b", config)  # a fresh engine, built from the HF folder again
    steps = group.load("run_b", ckpt)
    run_b = after_second_step("run_b")
    group.drop("run_b")
    return run_a, run_b, steps
