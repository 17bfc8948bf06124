"""The analytical cost model behind ``simu`` in Algorithm 2 (HybridFlow §6).

Three workloads, three regimes:

* training and inference (preparation) are compute-bound: ``6 N`` and ``2 N`` FLOPs per token
  (plus causal attention) over the device's achievable FLOP/s, stretched by the pipeline bubble
  ``(p - 1) / (m + p - 1)``, plus tensor-, pipeline- and data-parallel communication;
* generation is memory-bound: each decode step streams the generation shard of the weights
  (``M / t_g``) and the batch's KV cache from HBM, the batch split over ``n / t_g`` replicas,
  in as many waves as the free memory's KV capacity requires;
* the actor's training -> generation transition moves the Table-2 volume
  ``(tp - t_g p_g) / (t_g p_g tp) M`` per rank over the bandwidth of its gather group.

Two calibration knobs of the device profile add fixed costs the formulas above do not see:
``op_overhead_s`` per model call (dispatch, data transfer, switching models) and
``decode_step_overhead_ms`` per decode step (the rollout engine's host work); both default to 0.
Communication is not assumed to overlap with compute, which makes the model pessimistic for
data-parallel gradient reduction; see docs/auto_mapping.md for the full list of assumptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hf_core.planner.devices import DeviceCluster
from hf_core.planner.memory import kv_bytes_per_token, split_batch
from hf_core.planner.models import BF16_BYTES, ModelSpec
from hf_core.planner.workload import Workload
from hf_core.resharding import GenerationLayout, ParallelLayout, hybrid_engine_volume_fraction


def allreduce_seconds(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: each rank sends and receives ``2 (r - 1) / r`` of the buffer."""
    if ranks <= 1:
        return 0.0
    return latency + 2.0 * (ranks - 1) / ranks * nbytes / bandwidth


def _latency(cluster: DeviceCluster) -> float:
    """Fixed cost of one collective, seconds."""
    return cluster.device.collective_latency_us * 1e-6


def _pipeline_factor(micro_batches: int, pp: int) -> float:
    """``1 / (1 - bubble)`` with bubble ``(p - 1) / (m + p - 1)``: 1F1B's idle share."""
    return (micro_batches + pp - 1) / micro_batches


def train_seconds(
    spec: ModelSpec,
    layout: ParallelLayout,
    workload: Workload,
    cluster: DeviceCluster,
    sequences: int,
) -> float:
    """Seconds of the PPO update: ``epochs x mini_batches`` optimizer steps.

    Per step and replica: ``3 x`` forward FLOPs (``4 x`` with full recompute) over ``t p``
    devices; four TP all-reduces per layer and micro-batch (two forward, two backward);
    activations sent both ways across each pipeline boundary; the bubble; then a gradient
    all-reduce of ``2 N / (t p)`` bytes across the ``d`` replicas.
    """
    t, p, d = layout.tp, layout.pp, layout.dp
    mini_batch = math.ceil(sequences / workload.mini_batches)
    mbs, micro = split_batch(mini_batch, d, workload.micro_batch_size)
    full = workload.activation_recompute == "full"
    cost = _TRAIN_STEP_RECOMPUTED if full else _TRAIN_STEP
    step = _passes_seconds(spec, layout, workload, cluster, (mbs, micro), cost, "train")
    grads = BF16_BYTES * spec.num_params / (t * p)
    dp = allreduce_seconds(grads, d, cluster.group_bandwidth(layout.world_size), _latency(cluster))
    steps = workload.ppo_epochs * workload.mini_batches
    return steps * (step + dp) + cluster.device.op_overhead_s


def infer_seconds(
    spec: ModelSpec,
    layout: ParallelLayout,
    workload: Workload,
    cluster: DeviceCluster,
    sequences: int,
) -> float:
    """Seconds of one forward pass over the rollouts (log-probs, values or scores): ``2 N``
    FLOPs per token, two TP all-reduces per layer and micro-batch, one pipeline send, bubble."""
    batches = split_batch(sequences, layout.dp, workload.inference_micro_batch_size)
    one_pass = _passes_seconds(spec, layout, workload, cluster, batches, _FORWARD, "infer")
    return one_pass + cluster.device.op_overhead_s


@dataclass(frozen=True)
class _PassCost:
    """Per micro-batch: forward passes' worth of FLOPs, TP all-reduces per layer, activation
    sends per pipeline boundary."""

    flops: float
    allreduces: int
    sends: int


_FORWARD = _PassCost(1, 2, 1)
_TRAIN_STEP = _PassCost(3.0, 4, 2)
"""Forward and backward (twice the forward's FLOPs and all-reduces); activations go both ways."""
_TRAIN_STEP_RECOMPUTED = _PassCost(4.0, 6, 2)
"""Full activation recompute adds one more forward."""


def _passes_seconds(
    spec: ModelSpec,
    layout: ParallelLayout,
    workload: Workload,
    cluster: DeviceCluster,
    batches: tuple[int, int],
    cost: _PassCost,
    kind: Literal["train", "infer"],
) -> float:
    """``batches`` (micro-batch size, micro-batches) through one ``t x p`` replica at the
    device's ``kind`` FLOP/s, bubble included: what a training step and a forward pass share."""
    t, p = layout.tp, layout.pp
    s, h = workload.sequence_length, spec.hidden_size
    mbs, micro = batches
    alpha = _latency(cluster)
    flops = cost.flops * micro * mbs * s * spec.forward_flops_per_token(s / 2)
    flop_rate = cluster.device.train_flops() if kind == "train" else cluster.device.infer_flops()
    compute = flops / (t * p * flop_rate)
    tp_calls = cost.allreduces * micro * spec.num_layers / p
    tp = tp_calls * allreduce_seconds(mbs * s * h * BF16_BYTES, t, cluster.intra_bandwidth(), alpha)
    pp = 0.0
    if p > 1:
        boundary = mbs * s * h * BF16_BYTES / t
        pp = cost.sends * micro * (alpha + boundary / cluster.group_bandwidth(t * p))
    return (compute + tp + pp) * _pipeline_factor(micro, p)


@dataclass(frozen=True)
class GenerationEstimate:
    """Generation time and the memory it needed: the search's memory check uses ``kv_bytes``."""

    seconds: float
    replicas: int
    sequences_per_replica: int
    waves: int
    concurrent: int
    kv_bytes: float
    """KV cache per device at the largest wave."""


def generate(
    spec: ModelSpec,
    layout: ParallelLayout,
    gen_tp: int,
    workload: Workload,
    cluster: DeviceCluster,
    sequences: int,
    free_bytes: float,
) -> GenerationEstimate | None:
    """Rollout time with ``t_g``-way generation on the actor's ``n`` devices, or ``None`` when
    not even one sequence's KV cache fits in ``free_bytes`` per device.

    Replicas (``n / t_g``) each take an equal share of the sequences.  A replica can hold
    ``free / (KV per sequence)`` sequences at full length, so it runs in waves.  Each wave is
    a prefill (compute-bound, at least one pass over the weights) and ``response_length``
    decode steps, each ``max(bytes / HBM bandwidth, FLOPs / achievable FLOP/s)`` plus two TP
    all-reduces per layer; a step is costed at the mid-response context length.
    """
    dev = cluster.device
    replicas = layout.world_size // gen_tp
    per_replica = math.ceil(sequences / replicas)
    kv_token = kv_bytes_per_token(spec, gen_tp)
    per_sequence = kv_token * workload.sequence_length
    capacity = math.floor(free_bytes / per_sequence) if free_bytes > 0 else 0
    if capacity < 1:
        return None
    waves = math.ceil(per_replica / capacity)
    batch = math.ceil(per_replica / waves)
    lp, lr, h = workload.prompt_length, workload.response_length, spec.hidden_size
    alpha = _latency(cluster)
    bandwidth, flops = dev.memory_bandwidth(), gen_tp * dev.infer_flops()
    weights = BF16_BYTES * spec.matmul_params / gen_tp
    prefill = max(batch * lp * spec.forward_flops_per_token(lp / 2) / flops, weights / bandwidth)
    prefill += (
        2
        * spec.num_layers
        * allreduce_seconds(batch * lp * h * BF16_BYTES, gen_tp, cluster.intra_bandwidth(), alpha)
    )
    context = lp + lr / 2
    step = max(
        (weights + batch * context * kv_token) / bandwidth,
        batch * spec.forward_flops_per_token(context) / flops,
    )
    step += (
        2
        * spec.num_layers
        * allreduce_seconds(batch * h * BF16_BYTES, gen_tp, cluster.intra_bandwidth(), alpha)
    )
    step += dev.decode_step_overhead_ms * 1e-3
    return GenerationEstimate(
        seconds=waves * (prefill + lr * step) + dev.op_overhead_s,
        replicas=replicas,
        sequences_per_replica=per_replica,
        waves=waves,
        concurrent=batch,
        kv_bytes=batch * per_sequence,
    )


def transition_seconds(
    spec: ModelSpec, layout: ParallelLayout, gen_tp: int, cluster: DeviceCluster
) -> float:
    """The 3D-HybridEngine reshard: Table 2's per-rank volume over the bandwidth of the
    micro-DP gather group, which lives inside one DP replica of ``t p`` consecutive ranks."""
    fraction = hybrid_engine_volume_fraction(layout, GenerationLayout(pp=1, tp=gen_tp))
    if fraction == 0:
        return 0.0
    bandwidth = cluster.group_bandwidth(layout.model_parallel_size)
    return _latency(cluster) + fraction * spec.weight_bytes / bandwidth
