"""A test worker hosting megatron engines and rollout engines, plus losses and batches.

Importable by the Ray worker processes (the tests folder is on their PYTHONPATH), so loss
functions are passed by name rather than pickled from a test module.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_core.protocols import register
from hf_core.resharding import GenerationLayout, build_hybrid_plan, build_naive_plan
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


LOSSES = {"policy": policy_loss, "value": value_loss}


# ---------------------------------------------------------------------------- batches


def rollout_batch(
    batch_size: int, prompt_len: int, response_len: int, vocab_size: int, seed: int
) -> Batch:
    """Left-padded prompts + right-padded responses of uneven lengths, and RL targets."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab_size, (batch_size, prompt_len), generator=gen)
    responses = torch.randint(3, vocab_size, (batch_size, response_len), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    response_mask = torch.ones_like(responses)
    for i in range(batch_size):
        left = int(torch.randint(0, prompt_len - 1, (1,), generator=gen))
        kept = int(torch.randint(1, response_len + 1, (1,), generator=gen))
        prompt_mask[i, :left] = 0
        response_mask[i, kept:] = 0
    prompts = prompts.masked_fill(prompt_mask == 0, 0)
    responses = responses.masked_fill(response_mask == 0, 0)
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
        }
    )


def build_odd_vocab_model(path: Path, vocab_size: int) -> Path:
    """A random Llama with a vocabulary no TP size divides (no tokenizer: ids only)."""
    from transformers import AutoModelForCausalLM

    from hf_testing.tiny import tiny_config

    config = tiny_config("llama", vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def make_plan(layout: Any, t_g: int, kind: str) -> Any:
    build = build_hybrid_plan if kind == "hybrid" else build_naive_plan
    return build(layout, GenerationLayout(pp=1, tp=t_g))


# ----------------------------------------------------------------------------- worker


class MegatronWorker(Worker):
    """Hosts named megatron engines and rollout engines on each rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)  # four ranks share two cores
        self.engines: dict[str, Any] = {}
        self.rollouts: dict[str, Any] = {}

    @register("ONE_TO_ALL")
    def build(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        from hf_core.plugins import get_training_engine

        engine = get_training_engine("megatron")(**config)
        self.engines[name] = engine
        self.set_mesh(engine.worker_mesh())
        return {
            "coords": tuple(engine.layout.coords),
            "native": {n: tuple(p.shape) for n, p in engine.module.named_parameters()},
            "padded_vocab": engine.padded_vocab,
            "initialized": engine.initialized_heads,
        }

    @register("ONE_TO_ALL")
    def drop(self, name: str) -> None:
        self.engines.pop(name, None)
        self.rollouts.pop(name, None)

    @register("3D_PROTO")
    def log_probs(self, batch: Batch, name: str, temperature: float = 1.0) -> Batch:
        return self.engines[name].compute_log_probs(batch, temperature=temperature)

    @register("ONE_TO_ALL")
    def log_probs_everywhere(self, batch: Batch, name: str, temperature: float = 1.0) -> Batch:
        """The whole batch on every rank: what each rank (not just the collected one) returns."""
        return self.engines[name].compute_log_probs(batch, temperature=temperature)

    @register("3D_PROTO")
    def values(self, batch: Batch, name: str) -> Batch:
        return self.engines[name].compute_values(batch)

    @register("3D_PROTO")
    def train(self, batch: Batch, name: str, loss: str) -> dict[str, float]:
        return self.engines[name].train_step(batch, LOSSES[loss])

    @register("ONE_TO_ALL")
    def weights(self, name: str) -> dict[str, torch.Tensor] | None:
        """Full canonical weights (rank 0 returns them; every rank takes part)."""
        out = {n: t.clone() for b in self.engines[name].export_weights(1 << 16) for n, t in b}
        return out if self.rank == 0 else None

    @register("ONE_TO_ALL")
    def build_rollout(self, name: str, engine: str, model_path: str, t_g: int, kind: str) -> str:
        """An HF rollout engine (t_g = 1) or a megatron TP rollout engine on the plan's mesh."""
        from hf_core.plugins import get_rollout_engine

        source = self.engines[engine]
        plan = source.reshard_plan(gen_tp=t_g, kind=kind)
        if t_g == 1:
            rollout = get_rollout_engine("hf")(model_path=model_path)
        else:
            rollout = get_rollout_engine("megatron")(
                model_path=model_path, padded_vocab_size=source.padded_vocab, plan=plan
            )
        self.rollouts[name] = rollout
        self.set_mesh(source.worker_mesh(plan))  # 3D_ALL_MICRO_DP routes by this mesh
        return type(rollout).__name__

    @register("ONE_TO_ALL")
    def sync(
        self, engine: str, rollout: str, t_g: int, kind: str, bucket_bytes: int
    ) -> dict[str, Any]:
        """The 3D-HybridEngine transition into the colocated rollout engine; reports stats
        and the generation mesh."""
        from hf_megatron.hybrid import hybrid_sync

        source = self.engines[engine]
        plan = source.reshard_plan(gen_tp=t_g, kind=kind)
        assert plan == make_plan(source.layout.layout, t_g, kind)
        stats = hybrid_sync(source, self.rollouts[rollout], plan, bucket_bytes)
        self.set_mesh(source.worker_mesh(plan))
        out = stats.as_dict()
        out["recv_units_planned"] = sorted(plan.for_rank(self.rank).recv_units)
        return out

    @register("3D_ALL_MICRO_DP")
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
    def export_hf(self, name: str, path: str) -> str:
        return str(self.engines[name].export_hf(path))

    @register("ONE_TO_ALL")
    def rand(self) -> list[float]:
        return torch.rand(3).tolist()
