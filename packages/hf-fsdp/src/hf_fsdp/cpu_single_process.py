"""A single CPU process trains its model as a plain module, without FSDP (CPU only).

Why: at world size 1 FSDP2 still runs its machinery.  Before each unit's forward (and its
backward, when the unit was resharded) it copies every parameter into a freshly allocated
"gathered" buffer, and after the backward it concatenates the unit's gradients into one flat
buffer and copies them back out as the "reduce-scattered" shard, with nothing to gather or
reduce.  At the Qwen2.5-0.5B shape that was ~4.8 s of a ~30 s update on the 2-core
development VM (docs/performance.md): gigabytes copied several times a step at a few GB/s.

GPUs keep FSDP at any world size (device-memory copies cost little there, and it is what
users expect), and so does a CPU run with mixed precision (FSDP's policy casts the weights
for compute).  The plain module's parameters are ordinary tensors, which every path that
reads them already accepts: loading (a rank's slice is the whole tensor), export,
checkpoints (DCP saves them as whole tensors; a later run on more ranks loads its shards),
gradient clipping and the offload counts.
"""

from __future__ import annotations

import torch

from hf_fsdp.config import FSDPEngineConfig
from hf_fsdp.loading import mixed_precision


def trains_unsharded(cfg: FSDPEngineConfig, device: torch.device, world_size: int) -> bool:
    """Whether this engine skips ``fully_shard`` (``cpu_single_process: plain``)."""
    return (
        device.type == "cpu"
        and world_size == 1
        and cfg.cpu_single_process == "plain"
        and mixed_precision(cfg, device) is None
    )
