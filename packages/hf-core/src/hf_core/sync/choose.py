"""Which :class:`~hf_core.sync.protocol.WeightSync` an actor rank uses, decided once.

The placement and the engines decide it: no rollout engine in the actor's process (a
standalone pool) -> a broadcast; a LoRA actor -> adapters only (or merged weights); else the
plan-driven in-process sync.  The actor worker then calls one ``run`` and never branches.
"""

from __future__ import annotations

import torch

from hf_core.engines import RolloutEngine, TrainingEngine, TrainsAdapters
from hf_core.resharding import GenerationLayout
from hf_core.sync.broadcast import BroadcastSync
from hf_core.sync.hybrid import HybridSync
from hf_core.sync.lora import AdapterSync, lora_of
from hf_core.sync.plan import ReshardKind
from hf_core.sync.protocol import WeightSync
from hf_core.sync.wire import WireEncoder


def weight_sync_for(
    actor: TrainingEngine,
    rollout: RolloutEngine | None,
    *,
    bucket_bytes: int,
    kind: ReshardKind,
    rank: int,
    device: torch.device | None = None,
    generation: GenerationLayout | None = None,
    encoder: WireEncoder | None = None,
) -> WeightSync:
    """The actor's sync: :class:`BroadcastSync` to a rollout pool when ``rollout`` is
    ``None`` (it needs ``device``; ``encoder`` says what it sends), :class:`AdapterSync`
    when the actor trains LoRA adapters, else :class:`HybridSync` (its plan checked against
    the run's resolved ``generation`` layout when given)."""
    if rollout is None:
        if device is None:
            raise ValueError("a broadcast to a rollout pool needs the actor's device")
        return BroadcastSync(
            actor, bucket_bytes=bucket_bytes, rank=rank, device=device, encoder=encoder
        )
    lora = lora_of(actor)
    if lora is None:
        return HybridSync(
            actor, rollout, bucket_bytes=bucket_bytes, kind=kind, rank=rank, generation=generation
        )
    assert isinstance(actor, TrainsAdapters)
    return AdapterSync(actor, rollout, lora, bucket_bytes=bucket_bytes)
