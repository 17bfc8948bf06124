"""Typed configuration of the vLLM rollout engine.

A pydantic model with ``extra="forbid"``, validated by core's ``parse_engine_config``: a
misspelt key (say ``tensor_paralel_size``) fails loudly with one line naming the key, the
value and the keys that exist, instead of being silently ignored.  Anything vLLM accepts that
is not modelled here goes through ``engine_kwargs`` untouched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hf_core.config import EngineConfigError, parse_engine_config
from hf_core.engines import DTypeName, to_dtype
from hf_core.engines.hf_folder import read_model_config
from hf_core.engines.memory_fit import GIB

__all__ = ["EngineConfigError", "VLLMRolloutConfig", "parse_engine_config"]

CPU_DEFAULT_KV_CACHE_BYTES = GIB
"""A CPU engine's KV cache when neither ``kv_cache_bytes`` nor ``VLLM_CPU_KVCACHE_SPACE`` is
set: 43,648 tokens at the Qwen2.5-0.5B shape in float32 (24 layers, 2 KV heads of 64)."""
CPU_RUNTIME_BYTES = GIB
"""Resident bytes of a built CPU engine beyond its weights, KV cache and packed LM head (and
beyond the torch runtime): measured 0.9-1.0 GiB at the Qwen2.5-0.5B shape with 24 layers
and with 2, so it does not grow with the layers (docs/real_sizes.md)."""

ExecutorName = Literal["auto", "external_launcher", "uni"]


class VLLMRolloutConfig(BaseModel):
    """Everything one vLLM rollout engine (one per rank, hybrid mode) needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path = Field(description="local HuggingFace folder (config.json + weights)")
    dtype: DTypeName = Field(
        "float32", description="compute dtype; float32 keeps log-probs comparable to training"
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="t_g: ranks that form one engine (must divide the world size)"
    )
    distributed_executor_backend: ExecutorName = Field(
        "auto",
        description="auto: external_launcher inside a torch.distributed group, else uni",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="dummy: random init, for when a weight sync comes before generating"
    )
    enforce_eager: bool = Field(
        True, description="skip torch.compile / CUDA graphs (faster start, slower decode)"
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="share of device memory (hybrid: training needs the rest)"
    )
    kv_cache_bytes: int | None = Field(
        None,
        ge=1,
        description="explicit KV-cache size (on the CPU VLLM_CPU_KVCACHE_SPACE, when set, "
        "overrides it; CPU default 1 GiB; GPU default: gpu_memory_utilization decides)",
    )
    max_model_len: int | None = Field(None, ge=1, description="prompt + response tokens")
    max_num_seqs: int = Field(256, ge=1, description="sequences decoded together")
    max_num_batched_tokens: int | None = Field(None, ge=1)
    enable_prefix_caching: bool | None = Field(
        None,
        description="None: on, except for mixture-of-experts models (routing replay records "
        "each prompt token's experts, and a prompt token served from the cache is not routed "
        "again)",
    )
    ignore_eos: bool = Field(False, description="decode to max_new_tokens (benchmarks)")
    sleep_level: Literal[1, 2] = Field(
        1, description="GPU release_memory: 1 offloads weights, 2 drops them (full sync needed)"
    )
    torch_threads: int | None = Field(
        1,
        ge=1,
        description="torch threads while generating (vLLM serves with 1: multi-threaded ops "
        "spin-wait between its serial steps); None keeps the trainer's setting",
    )
    seed: int = Field(0, description="per-request sampling seeds when SamplingParams.seed is None")
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        description="serve the LoRA actor's adapters (rank up to this; vLLM takes 1, 8, 16, "
        "32, 64, ...): each weight sync then moves only the adapters; None: merged weights",
    )
    check_lockstep: bool = Field(
        True, description="TP>1: verify all ranks of an engine got the same prompts"
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="passed to vllm.LLM as is (overrides the above)"
    )

    def cpu_kv_cache_bytes(self) -> int:
        """The KV cache a CPU engine allocates: ``VLLM_CPU_KVCACHE_SPACE`` GiB when set (vLLM
        lets it override every other setting on the CPU), else ``kv_cache_bytes``, else
        :data:`CPU_DEFAULT_KV_CACHE_BYTES`.

        Left to itself, vLLM's CPU worker grows its process to ``gpu_memory_utilization`` of
        the node's memory: two hybrid ranks at the default 0.5 would ask for the whole node
        before training holds a byte.  A fixed size keeps the training engine's share.
        """
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
        if space.strip():
            return int(space) * GIB
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        return CPU_DEFAULT_KV_CACHE_BYTES

    def prefix_caching(self, mixture_of_experts: bool) -> bool:
        """Whether the engine caches prompt prefixes (see ``enable_prefix_caching``)."""
        if self.enable_prefix_caching is None:
            return not mixture_of_experts
        return self.enable_prefix_caching

    def routed_experts_unsupported(self) -> str | None:
        """Why this engine would not return an MoE model's experts (``DeclaresRoutedExperts``;
        asked for MoE models only): prefix caching switched on explicitly, because a prompt
        token served from the cache is not routed again (:mod:`hf_vllm.routed_experts_capture`)."""
        if self.enable_prefix_caching:
            return (
                "rollout.engine.enable_prefix_caching is true: a prompt token vLLM serves from "
                "its prefix cache is not routed again, so its experts cannot be recorded; leave "
                "it unset (off for mixture-of-experts models) or set it to false"
            )
        return None

    def sequence_capacity(self, kv_elements_per_token: int) -> tuple[int, str] | None:
        """The longest sequence this engine can hold (``DeclaresSequenceCapacity``):
        ``max_model_len`` when set, and what one sequence may take of a KV cache of fixed
        size (always on the CPU; on a GPU only with ``kv_cache_bytes``), this rank's heads'
        share in ``dtype``."""
        import torch

        limits: list[tuple[int, str]] = []
        if self.max_model_len is not None:
            limits.append((self.max_model_len, "rollout.engine.max_model_len"))
        on_gpu = torch.cuda.is_available()
        cache = self.kv_cache_bytes if on_gpu else self.cpu_kv_cache_bytes()
        if cache is not None:
            per_token = kv_elements_per_token * to_dtype(self.dtype).itemsize
            per_token = max(1, per_token // self.tensor_parallel_size)
            if not on_gpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip():
                source = "VLLM_CPU_KVCACHE_SPACE"
            else:
                source = "rollout.engine.kv_cache_bytes"
            limits.append((cache // per_token, f"the {cache / GIB:.2f} GiB KV cache ({source})"))
        return min(limits) if limits else None

    def packed_head_bytes(self) -> int:
        """The CPU engine's packed copy of this rank's LM head, kept beside the original
        (vocabulary x hidden in ``dtype``; :mod:`hf_vllm.cpu_embedding`)."""
        config = read_model_config(Path(self.model_path), key="rollout.engine.model_path")
        text = config.get("text_config") or config
        head = int(text["vocab_size"]) * int(text["hidden_size"]) * to_dtype(self.dtype).itemsize
        return head // self.tensor_parallel_size

    def host_overhead_bytes(self) -> int:
        """What a CPU engine holds beyond its weights: KV cache, the packed LM head and
        vLLM's own runtime (:data:`CPU_RUNTIME_BYTES`), for the pre-start memory check."""
        return self.cpu_kv_cache_bytes() + self.training_overhead_bytes()

    def training_overhead_bytes(self) -> int:
        """The same while the actor trains: the KV cache's pages are handed back then
        (:mod:`hf_vllm.cpu_kv_cache`)."""
        return self.packed_head_bytes() + CPU_RUNTIME_BYTES
