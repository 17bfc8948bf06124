"""The sync of an actor that trains LoRA adapters: move only what changed when possible.

A rollout engine that serves adapters (:class:`~hf_core.engines.ServesAdapters`, e.g. vLLM)
gets only the adapters after each update -- a few MB instead of the model; any other (the HF
engine, SGLang on CPU) gets the merged weights ``W + (alpha / r) B A`` through the usual
bucketed stream.  Either way ``lora/sync_bytes`` says what moved.
"""

from __future__ import annotations

import logging
import time

from hf_core.engines import (
    LoRAConfig,
    RolloutEngine,
    ServesAdapters,
    TrainingEngine,
    TrainsAdapters,
    tensor_nbytes,
)

log = logging.getLogger(__name__)


def lora_of(engine: TrainingEngine) -> LoRAConfig | None:
    """The engine's LoRA settings, or ``None`` when it trains the whole model."""
    return engine.lora_config() if isinstance(engine, TrainsAdapters) else None


class AdapterSync:
    """The sync of a LoRA actor: adapters only into an engine that serves them, else merged
    weights in buckets.  Every rank calls :meth:`run` together (the exports gather shards)."""

    def __init__(
        self,
        actor: TrainsAdapters,
        rollout: RolloutEngine,
        lora: LoRAConfig,
        *,
        bucket_bytes: int,
    ) -> None:
        if not isinstance(actor, TrainingEngine):
            raise TypeError(f"{type(actor).__name__} is not a training engine")
        self.actor, self.rollout, self.lora = actor, rollout, lora
        self.bucket_bytes = bucket_bytes
        self.adapters_only = isinstance(rollout, ServesAdapters) and rollout.serves_adapters(lora)
        if isinstance(rollout, ServesAdapters) and not self.adapters_only:
            log.warning(
                "%s can serve LoRA adapters but was not built for rank %d (see its LoRA "
                "settings, e.g. rollout.engine.max_lora_rank): syncing merged weights",
                type(rollout).__name__,
                lora.rank,
            )

    def run(self, version: int = 0) -> dict[str, float]:
        """One sync (``version`` is not needed in-process); this rank's metrics."""
        start = time.perf_counter()
        sent = 0
        if self.adapters_only:
            assert isinstance(self.rollout, ServesAdapters)
            tensors = [
                item for bucket in self.actor.export_adapters(self.bucket_bytes) for item in bucket
            ]
            sent = sum(tensor_nbytes(t) for _, t in tensors)
            self.rollout.load_adapter(self.lora, tensors)
        else:
            assert isinstance(self.actor, TrainingEngine)
            for bucket in self.actor.export_weights(self.bucket_bytes):
                sent += sum(tensor_nbytes(t) for _, t in bucket)
                self.rollout.load_weights(bucket)
        self.rollout.finish_weight_sync()
        metrics = {
            "perf/weight_sync_s": time.perf_counter() - start,
            "lora/sync_bytes": float(sent),
            "lora/adapters_only": float(self.adapters_only),
        }
        metrics.update(self.rollout.sync_metrics())
        return metrics
