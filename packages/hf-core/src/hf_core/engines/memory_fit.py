"""What one training process holds, and what fits the memory it has.

A process of a colocated run holds, at its peak (the actor's update):

* **state**: the trained model's weights, gradients and Adam's two moments in the parameter
  dtype, sharded over the data-parallel ranks (FSDP); a frozen model's weights alone;
* **gathered**: the unsharded parameters of the unit being computed (one decoder layer, or
  the whole model when it is one FSDP unit);
* **rollout copy**: a colocated rollout engine's full weights;
* **activations**: what the backward needs per token of the micro-batch, over all layers
  (only each layer's input with gradient checkpointing, plus one layer being recomputed);
* **loss**: the LM head's float32 logits and their gradient, bounded by the chunked head
  (:mod:`hf_core.algorithms.chunked_head`) to about two chunks plus the head's gradient;
* **runtime**: torch, transformers and the Ray worker themselves.

The figures are estimates for the defaults to be chosen from (micro-batch tokens, gradient
checkpointing) and for a run that cannot fit to say so before it starts; bench/scale.py
measures the real peaks next to them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_core.model_shapes import ModelSpec

GIB = 1024**3
RUNTIME_BYTES = GIB
"""torch, transformers and a Ray worker before any model (measured 0.4-0.9 GiB on CPU)."""
DRIVER_RESERVE_BYTES = 2 * GIB
"""Left on a node for the driver, Ray's own processes and the page cache the loads need."""
DEFAULT_MAX_TOKENS = 16384
"""The most tokens a micro-batch gets by default, even when more would fit."""
CHECKPOINTING_MIN_TOKENS = 4096
"""Gradient checkpointing turns on (``auto``) when fewer tokens than this fit without it."""


def activation_elements_per_token_layer(spec: ModelSpec) -> int:
    """Elements one decoder layer keeps per token for its backward, without checkpointing:
    norms' inputs and outputs, q/k/v, the attention output and residual (about ``8 h + 2
    kv``), and the gated MLP's gate, up, activation and product (``4 i``)."""
    return 8 * spec.hidden_size + 2 * spec.kv_dim + 4 * spec.intermediate_size


@dataclass(frozen=True)
class TrainingFootprint:
    """One training engine's share of a process, for a model ``spec`` sharded over ``ranks``.

    ``param_bytes``: bytes per parameter of the master weights (and so of gradients and Adam
    states); ``compute_bytes``: bytes per activation element (the mixed-precision dtype).
    """

    spec: ModelSpec
    ranks: int
    param_bytes: int
    compute_bytes: int
    trainable: bool = True
    per_layer_units: bool = True
    logits_budget_bytes: int = 256 * 1024**2
    declared_state_bytes: int | None = None
    """What the engine's settings declare for :meth:`state_bytes`
    (:class:`~hf_core.engines.DeclaresTrainingState`), when they do."""

    def state_bytes(self) -> int:
        if self.declared_state_bytes is not None:
            return self.declared_state_bytes
        copies = 4 if self.trainable else 1  # weights, gradients, Adam's m and v
        return copies * self.param_bytes * self.spec.num_params // self.ranks

    def gathered_bytes(self) -> int:
        """The largest unit gathered whole on a sharded rank, and for a trained model its
        unsharded gradient beside it until the reduce-scatter (the root unit -- embeddings,
        a tied head, the final norm -- holds both through the whole backward)."""
        if self.ranks == 1:
            return 0
        if self.per_layer_units:  # the root (embeddings, head, norm) stays gathered
            layer = self.spec.layer_matmul_params + 2 * self.spec.hidden_size
            unit = self.spec.num_params - (self.spec.num_layers - 1) * layer
        else:
            unit = self.spec.num_params
        copies = 2 if self.trainable else 1
        return copies * self.compute_bytes * unit

    def activation_bytes_per_token(self, checkpointing: bool) -> int:
        per_layer = activation_elements_per_token_layer(self.spec)
        if checkpointing:
            elements = self.spec.num_layers * self.spec.hidden_size + per_layer
        else:
            elements = self.spec.num_layers * per_layer
        return self.compute_bytes * elements

    def loss_bytes(self, tokens: int) -> int:
        """Float32 logits and their gradient, or two chunks and the head's gradient."""
        if self.spec.value_head or not self.trainable:
            full = 4 * tokens * self.spec.logits_width
            return min(full, self.logits_budget_bytes)
        full = 2 * 4 * tokens * self.spec.vocab_size
        chunked = 2 * self.logits_budget_bytes + 4 * self.spec.vocab_size * self.spec.hidden_size
        return min(full, chunked)

    def peak_bytes(self, tokens: int, checkpointing: bool) -> dict[str, int]:
        """The estimate's parts for a micro-batch of ``tokens`` tokens."""
        return {
            "state": self.state_bytes(),
            "gathered": self.gathered_bytes(),
            "activations": tokens * self.activation_bytes_per_token(checkpointing),
            "loss": self.loss_bytes(tokens),
        }


@dataclass(frozen=True)
class MicroBatchFit:
    """The micro-batch a process can afford: tokens, checkpointing and the estimate behind."""

    max_tokens: int
    gradient_checkpointing: bool
    parts: dict[str, int]
    budget_bytes: int
    tokens_without_checkpointing: int = 0
    """Micro-batch tokens that fit without recompute: an update whose micro-batches are all
    this small needs no checkpointing even where larger ones would."""

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {size_text(v)}" for k, v in self.parts.items() if v)
        return (
            f"estimated peak {size_text(self.total_bytes)} ({parts}) against a budget of "
            f"{size_text(self.budget_bytes)} per process"
        )


def size_text(nbytes: int) -> str:
    """``1.50 GiB`` or ``12.3 MiB``."""
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def fit_micro_batch(
    footprint: TrainingFootprint,
    budget_bytes: int,
    *,
    resident_bytes: int = 0,
    checkpointing: bool | None = None,
    min_tokens: int = 1,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> MicroBatchFit:
    """The largest micro-batch (at most ``max_tokens``) whose estimate fits ``budget_bytes``
    with ``resident_bytes`` already taken (other engines, the runtime).

    ``checkpointing=None`` decides it: off when at least :data:`CHECKPOINTING_MIN_TOKENS`
    (or ``max_tokens``) fit without it.  A result whose total exceeds the budget means not
    even ``min_tokens`` fit: the caller reports it.
    """
    choices = [checkpointing] if checkpointing is not None else [False, True]
    fit = None
    without = 0
    for choice in choices:
        fixed = footprint.peak_bytes(0, choice)
        fixed["loss"] = footprint.loss_bytes(max_tokens)
        room = budget_bytes - resident_bytes - sum(fixed.values())
        tokens = min(max_tokens, max(0, room) // footprint.activation_bytes_per_token(choice))
        if not choice:
            without = tokens
        parts = {
            "resident": resident_bytes,
            **footprint.peak_bytes(max(tokens, min_tokens), choice),
        }
        fit = MicroBatchFit(max(tokens, min_tokens), choice, parts, budget_bytes, without)
        if tokens >= min(CHECKPOINTING_MIN_TOKENS, max_tokens) and tokens >= min_tokens:
            return fit
    assert fit is not None
    return fit


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def node_memory_bytes() -> int:
    """Memory this machine (or its cgroup limit, when lower) has in all."""
    limits = [_meminfo("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    limits += [v for v in (_read_int(Path(limit)) for limit, _ in _CGROUP_FILES) if v]
    return min(limits)


def available_bytes() -> int:
    """Memory that can still be taken now: the kernel's ``MemAvailable``, or what is left
    under a cgroup limit when that is less."""
    free = [_meminfo("MemAvailable") or node_memory_bytes()]
    for limit_file, usage_file in _CGROUP_FILES:
        limit, usage = _read_int(Path(limit_file)), _read_int(Path(usage_file))
        if limit and usage is not None and limit < 2**60:
            free.append(max(0, limit - usage))
    return min(free)


RAY_KILL_THRESHOLD = 0.95
"""Ray's memory monitor kills a worker once the node's used memory passes this share of its
total (``RAY_memory_usage_threshold``, Ray's default)."""


def ray_kill_margin_bytes(total: int) -> int:
    """Memory Ray's monitor keeps unused on a node of ``total`` bytes: a process that grows into
    it is killed, so no budget may count it (0 when the monitor is off,
    ``RAY_memory_monitor_refresh_ms=0``)."""
    if os.environ.get("RAY_memory_monitor_refresh_ms") == "0":
        return 0
    threshold = float(os.environ.get("RAY_memory_usage_threshold", RAY_KILL_THRESHOLD))
    return round(max(0.0, 1.0 - threshold) * total)


def process_budget_bytes(processes_on_node: int, node_bytes: int | None = None) -> int:
    """One of ``processes_on_node`` engine processes' share of the node, after the reserve
    for the driver and Ray (:data:`DRIVER_RESERVE_BYTES`) and the margin below Ray's kill
    line (:func:`ray_kill_margin_bytes`)."""
    total = node_memory_bytes() if node_bytes is None else node_bytes
    usable = total - DRIVER_RESERVE_BYTES - ray_kill_margin_bytes(total)
    return max(0, usable) // max(1, processes_on_node)


def growth_budget_bytes(processes_on_node: int, reserve_bytes: int = GIB) -> int:
    """What this process may still add, when ``processes_on_node`` processes (this one
    included) are about to grow alike (the ranks of a data-parallel update): an equal share
    of the memory available now, less ``reserve_bytes`` kept free for the rest of the node
    and the margin below Ray's kill line."""
    free = available_bytes() - reserve_bytes - ray_kill_margin_bytes(node_memory_bytes())
    return max(0, free) // max(1, processes_on_node)


def device_growth_budget_bytes(
    device: torch.device, reserve_bytes: int = GIB, growing_processes: int | None = None
) -> int:
    """:func:`growth_budget_bytes` for an engine on ``device``: on a GPU, what the device has
    free now (one rank per GPU, so no share to split), less ``reserve_bytes`` for the CUDA
    context's later allocations; on the CPU, this process's share of the node, among
    ``growing_processes`` (default: every rank of its group on the node, as
    :func:`local_processes`)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(0, free - reserve_bytes)
    sharing = local_processes() if growing_processes is None else growing_processes
    return growth_budget_bytes(sharing, reserve_bytes)


def local_processes() -> int:
    """Ranks of this process's group on its node (``LOCAL_WORLD_SIZE``, set by the runtime
    as torchrun does; 1 when unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
