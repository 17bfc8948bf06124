"""Per-device memory accounting: what must stay resident and what comes and goes per stage.

Persistent state (weights, gradients, Adam states) lives for the whole run, so colocated models
add theirs up.  Transient memory (activations, the generation shard and KV cache) exists only
while its model runs; colocated models run one after another, so only the largest counts.
"""

from __future__ import annotations

import math

from hf_core.planner.models import BF16_BYTES, ModelSpec
from hf_core.planner.workload import Workload
from hf_core.resharding import ParallelLayout

GRAD_BYTES = 2
"""bf16 gradients."""
ADAM_BYTES = 12
"""fp32 master weights plus Adam's two moments."""
TRAINED_BYTES_PER_PARAM = BF16_BYTES + GRAD_BYTES + ADAM_BYTES
"""16 bytes per parameter for a model trained in mixed precision with Adam."""
INFERENCE_BYTES_PER_PARAM = BF16_BYTES
"""2 bytes per parameter for a model that only runs forward passes."""
ACTIVATION_FACTOR = 34
"""Bytes per (token x hidden) per layer with sequence parallelism and selective recompute
(Korthikanti et al., 2022): ``34 s b h / t`` per layer."""
LOGIT_BYTES = 4
"""Logits are materialised in fp32 for log-probabilities."""


def state_bytes(spec: ModelSpec, trained: bool) -> float:
    """All persistent bytes of a model, before sharding (16 or 2 bytes per parameter)."""
    per_param = TRAINED_BYTES_PER_PARAM if trained else INFERENCE_BYTES_PER_PARAM
    return float(per_param * spec.num_params)


def persistent_bytes(
    spec: ModelSpec, layout: ParallelLayout, trained: bool, distributed_optimizer: bool = True
) -> float:
    """Per-device resident bytes: weights and gradients split over ``t * p``; Adam states over
    ``t * p * d`` with a distributed optimizer (Megatron), else over ``t * p``."""
    n = spec.num_params
    mp = layout.model_parallel_size
    if not trained:
        return INFERENCE_BYTES_PER_PARAM * n / mp
    optim_shards = mp * layout.dp if distributed_optimizer else mp
    return (BF16_BYTES + GRAD_BYTES) * n / mp + ADAM_BYTES * n / optim_shards


def split_batch(sequences: int, replicas: int, micro: int) -> tuple[int, int]:
    """``(micro-batch size, micro-batches)`` of one replica; an uneven split costs the largest
    share, which is what the slowest replica processes."""
    per_replica = max(1, math.ceil(sequences / replicas))
    size = min(micro, per_replica)
    return size, math.ceil(per_replica / size)


def train_activation_bytes(spec: ModelSpec, layout: ParallelLayout, workload: Workload) -> float:
    """Peak activations of a 1F1B pipeline stage: ``min(p, m)`` micro-batches in flight over
    ``L / p`` layers, plus fp32 logits and their gradient on the last stage."""
    seqs = workload.sequences() / workload.mini_batches
    mbs, micro = split_batch(math.ceil(seqs), layout.dp, workload.micro_batch_size)
    s, h, t = workload.sequence_length, spec.hidden_size, layout.tp
    per_layer = ACTIVATION_FACTOR * s * mbs * h / t
    layers = spec.num_layers / layout.pp
    in_flight = min(layout.pp, micro)
    if workload.activation_recompute == "full":
        stored = layers * in_flight * BF16_BYTES * s * mbs * h / t + per_layer
    else:
        stored = layers * in_flight * per_layer
    logits = 2 * LOGIT_BYTES * s * mbs * spec.logits_width / t
    return stored + logits


def infer_activation_bytes(spec: ModelSpec, layout: ParallelLayout, workload: Workload) -> float:
    """A forward pass keeps one layer's working set and the fp32 logits of a micro-batch."""
    mbs, _ = split_batch(workload.sequences(), layout.dp, workload.inference_micro_batch_size)
    s, t = workload.sequence_length, layout.tp
    return (ACTIVATION_FACTOR * spec.hidden_size + LOGIT_BYTES * spec.logits_width) * s * mbs / t


def kv_bytes_per_token(spec: ModelSpec, gen_tp: int) -> float:
    """KV bytes per token on one device of a ``gen_tp``-way generation group; KV heads are
    split across ranks and replicated once ``gen_tp`` exceeds their number."""
    heads_per_rank = math.ceil(spec.num_kv_heads / gen_tp)
    return spec.kv_bytes_per_token * heads_per_rank / spec.num_kv_heads


def generation_weight_bytes(spec: ModelSpec, layout: ParallelLayout, gen_tp: int) -> float:
    """Extra weight bytes while generating: the 3D-HybridEngine gathers a ``1 / t_g`` shard
    that contains the rank's own ``1 / (t p)`` training shard (zero redundancy, Table 2).

    None when the training shard already holds it: a data-parallel layout (``t = p = 1``)
    keeps whole tensors, of which a ``t_g``-way rollout uses a slice."""
    return spec.weight_bytes * max(0.0, 1.0 / gen_tp - 1.0 / layout.model_parallel_size)
