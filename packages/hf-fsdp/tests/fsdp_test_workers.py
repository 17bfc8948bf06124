"""A test worker wrapping the FSDP and transformers engines (losses, batches: hf_testing.workers).

Importable by the Ray worker processes (the tests folder is put on their PYTHONPATH), so loss
functions are passed by name rather than pickled from a test module.
"""

from __future__ import annotations

import functools
from typing import Any

from hf_core.batch import Batch
from hf_core.engines import SamplingParams
from hf_core.protocols import register
from hf_testing.workers import engine_worker_base


def _step_with_gradients(engine: Any, batch: Batch, loss: Any) -> tuple[dict[str, float], dict]:
    """``engine.train_step(batch, loss)``'s metrics and the full gradients its optimizer
    applied (gathered from FSDP's shards; none on a rank without an optimizer)."""
    grads: dict[str, Any] = {}

    def capture(*_args: object) -> None:
        for key, param in engine.model.named_parameters():
            grad = param.grad
            if grad is not None:
                full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
                grads[key] = full.clone()

    handle = engine.optimizer.register_step_pre_hook(capture) if engine.optimizer else None
    metrics = engine.train_step(batch, loss)
    if handle is not None:
        handle.remove()
    return metrics, grads


class EngineWorker(engine_worker_base("DP_PROTO")):
    """Hosts named FSDP training engines and transformers rollout engines on each rank."""

    @register("ONE_TO_ALL")
    def build(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        from hf_fsdp.engine import FSDPEngine

        engine = FSDPEngine(config)
        self.engines[name] = engine
        report = engine.load_report
        return {
            "initialized": report.initialized,
            "unused": report.unused,
            "collectives": engine.data_parallel.collectives,
            "strategy": engine.data_parallel_strategy(),
        }

    @register("ONE_TO_ALL")
    def local_digest(self, name: str) -> str:
        """A digest of this rank's own parameter bytes (replicas must agree bit for bit)."""
        import hashlib

        import torch

        digest = hashlib.sha256()
        for param in self.engines[name].model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            digest.update(local.detach().contiguous().view(-1).view(torch.uint8).numpy())
        return digest.hexdigest()

    @register("ONE_TO_ALL")
    def whole_batch_step(self, batch: Batch, name: str, loss: str) -> dict[str, Any]:
        """The same batch on every rank (what a sequence-parallel group receives): its
        per-token outputs, then one update; the outputs, the step's metrics and the full
        gradients the optimizer applied."""
        from hf_testing.workers import LOSSES

        engine = self.engines[name]
        top_k = int(batch.meta.get("top_k", 0))  # the lm head's own top-k, when asked
        forward = {
            "lm": functools.partial(engine.compute_log_probs, top_k=top_k),
            "value": engine.compute_values,
            "score": engine.compute_scores,
        }[engine.config.head]
        outputs = forward(batch)
        metrics, grads = _step_with_gradients(engine, batch, LOSSES[loss])
        return {"outputs": outputs, "metrics": metrics, "grads": grads}

    @register("DP_PROTO")
    def captured_step(
        self, batch: Batch, name: str, loss: str, grad_scale: float = 1.0
    ) -> dict[str, Any]:
        """One update of this rank's share of ``batch``: its metrics, the full gradients the
        optimizer applied (on the ranks holding one) and the updated weights.
        ``grad_scale`` != 1 multiplies the gradients after the strategy reduced them: a
        deliberately wrong scale, which an equality check must catch."""
        from hf_testing.workers import LOSSES

        engine = self.engines[name]
        if grad_scale != 1.0:
            reduce = engine.data_parallel.reduce_gradients

            def wrong(params: list[Any]) -> None:
                reduce(params)
                for param in params:
                    if param.grad is not None:
                        param.grad.mul_(grad_scale)

            engine.data_parallel.reduce_gradients = wrong
        metrics, grads = _step_with_gradients(engine, batch, LOSSES[loss])
        weights = {k: v for bucket in engine.export_weights(1 << 20) for k, v in bucket}
        return {"metrics": metrics, "grads": grads, "weights": weights}

    @register("DP_PROTO")
    def train_widened(self, batch: Batch, name: str, loss: str) -> dict[str, float]:
        """``train``, with odd ranks' prompts one left-padding column wider: the ranks'
        batches then differ in width (same samples, same numbers)."""
        import torch

        from hf_testing.workers import LOSSES

        if self.rank % 2:
            widened = batch.select(*batch.keys())
            for key in ("prompts", "input_ids", "attention_mask", "position_ids"):
                value = batch[key]
                widened[key] = torch.cat([value.new_zeros(value.shape[0], 1), value], dim=1)
            batch = widened
        return self.engines[name].train_step(batch, LOSSES[loss])

    @register("DP_PROTO")
    def train_with_free_memory(
        self, batch: Batch, name: str, loss: str, free_bytes: int
    ) -> dict[str, int]:
        """``train`` while the node appears to have ``free_bytes`` available: the update
        budget the engine chose then (growth only, this rank's weights left out), and the
        growth budget of one process and of this rank's share of the node, for comparison."""
        from unittest import mock

        from hf_core.engines import memory_fit
        from hf_fsdp import fit
        from hf_testing.workers import LOSSES

        engine = self.engines[name]
        with mock.patch.object(memory_fit, "available_bytes", lambda: free_bytes):
            engine.train_step(batch, LOSSES[loss])
            alone = memory_fit.growth_budget_bytes(1)
            share = memory_fit.growth_budget_bytes(memory_fit.local_processes())
        assert engine.fit is not None
        chosen = engine.fit.budget_bytes - fit.local_weight_bytes(engine.model)
        return {"chosen": chosen, "alone": alone, "share": share}

    @register("ONE_TO_ALL")
    def build_rollout(self, name: str, config: dict[str, Any]) -> None:
        from hf_fsdp.rollout import TransformersRolloutEngine

        self.rollouts[name] = TransformersRolloutEngine(config)

    @register("DP_PROTO")
    def scores(self, batch: Batch, name: str) -> Batch:
        return self.engines[name].compute_scores(batch)

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

    @register("ONE_TO_ALL")
    def hybrid_sync(self, name: str, rollout: str, bucket_bytes: int) -> int:
        """Core's in-process sync (as the actor worker runs it); the tensors this rank's
        rollout engine loaded."""
        from hf_core.sync.hybrid import HybridSync

        target = self.rollouts[rollout]
        loaded: list[int] = []
        load = target.load_weights

        def counting(bucket: Any) -> None:
            bucket = list(bucket)
            loaded.append(len(bucket))
            load(bucket)

        target.load_weights = counting
        try:
            HybridSync(self.engines[name], target, bucket_bytes=bucket_bytes, rank=self.rank).run()
        finally:
            del target.load_weights
        return sum(loaded)

    @register("DP_PROTO")
    def generate(self, batch: Batch, rollout: str, params: dict[str, Any]) -> Batch:
        return self.rollouts[rollout].generate(batch, SamplingParams(**params))

    @register("ONE_TO_ALL")
    def export_hf(self, name: str, path: str, tokenizer: str | None = None) -> str:
        return str(self.engines[name].export_hf(path, tokenizer=tokenizer))
