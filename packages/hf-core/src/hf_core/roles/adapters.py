"""An actor that trains LoRA adapters: what it syncs, and the reference policy for free.

Weight sync: a rollout engine that serves adapters (:class:`~hf_core.engines.ServesAdapters`,
e.g. vLLM) gets only the adapters after each update -- a few MB instead of the model; any
other (the HF engine, SGLang on CPU) gets the merged weights ``W + (alpha / r) B A`` through
the usual bucketed stream.  Either way ``lora/sync_bytes`` says what moved.

Reference: when the recipe's reference policy is the actor's own base weights, the actor with
its adapters disabled computes it -- the base weights are in memory once, not twice.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Protocol

from hf_core.config import TrainerConfig
from hf_core.engines import (
    LoRAConfig,
    RolloutEngine,
    ServesAdapters,
    TrainingEngine,
    TrainsAdapters,
    tensor_nbytes,
)
from hf_core.roles.weight_sync import ReshardKind, WeightSync

log = logging.getLogger(__name__)


class Sync(Protocol):
    """One weight sync from the actor into its rollout engine; returns the step's metrics."""

    def run(self) -> dict[str, float]: ...


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

    def run(self) -> dict[str, float]:
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


def weight_sync_for(
    actor: TrainingEngine,
    rollout: RolloutEngine,
    *,
    bucket_bytes: int,
    kind: ReshardKind,
    rank: int,
) -> Sync:
    """The actor's sync: :class:`AdapterSync` when it trains LoRA adapters, else core's
    :class:`~hf_core.roles.weight_sync.WeightSync`."""
    lora = lora_of(actor)
    if lora is None:
        return WeightSync(actor, rollout, bucket_bytes=bucket_bytes, kind=kind, rank=rank)
    assert isinstance(actor, TrainsAdapters)
    return AdapterSync(actor, rollout, lora, bucket_bytes=bucket_bytes)


def reference_is_actor_base(config: TrainerConfig, actor: TrainingEngine) -> bool:
    """Whether the reference policy is the LoRA actor's own base model (the same backend and
    weights): then it is the actor with adapters disabled, and no reference engine is built."""
    reference = config.reference
    if reference is None or lora_of(actor) is None:
        return False
    return reference.backend == config.actor.backend and config.role_model(
        reference
    ) == config.role_model(config.actor)


def base_model(actor: TrainingEngine) -> AbstractContextManager[None]:
    """A scope in which the LoRA actor computes as its base model."""
    if not isinstance(actor, TrainsAdapters):
        raise TypeError(f"{type(actor).__name__} trains no adapters: it has no base model scope")
    return actor.adapters_disabled()
