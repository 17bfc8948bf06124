"""Typed configuration of the FSDP training engine and the transformers rollout engine.

Both are pydantic models with ``extra="forbid"``, so a misspelt key fails loudly instead of
being ignored.  :func:`parse_config` turns pydantic's report into one :class:`EngineConfigError`
whose lines name each bad key, the value given and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hf_core.algorithms.chunked_head import DEFAULT_LOGITS_BUDGET_BYTES
from hf_core.config import EngineConfigError, parse_engine_config  # noqa: F401  (re-exported)
from hf_core.engines import (  # noqa: F401  (HeadKind, to_dtype re-exported)
    DTypeName,
    HeadKind,
    LoRAConfig,
    TrainingEngineConfig,
    to_dtype,
)
from hf_core.renamed import (
    HF_MEANS_HYBRIDFLOW,
    POOL_MEANS_RESOURCES,
    THE_LEADER,
    refuse_renamed_keys,
    refuse_renamed_value,
    renamed_attributes,
)
from hf_fsdp.data_parallel import choice

CPULinear = Annotated[
    Literal["onednn", "aten"],
    Field(
        description="CPU float32 linear layers of 64 rows and more: oneDNN's AVX-512 GEMM, "
        "or aten (MKL); see hf_fsdp.onednn_linear"
    ),
]


SHARED_MEMORY_FILE_BYTES = 32 * 1024 * 1024
"""The largest file FSDP's CPU ranks on one node copy their collectives through (one per node
and process group, whatever the rank count; a model whose units need less gets a smaller one:
hf_fsdp.cpu_shared_memory)."""


class FSDPEngineConfig(TrainingEngineConfig):
    """Everything one FSDP training engine (any role) needs.

    The model, optimiser, schedule and placement keys are core's
    :class:`~hf_core.engines.TrainingEngineConfig` (the same meaning on every backend); the
    keys here are FSDP's numerics, sharding and offload switches.
    """

    max_tokens_per_micro_batch: int | Literal["auto"] | None = Field(
        "auto",
        description="token budget of a micro-batch: samples grouped by length, each "
        "micro-batch trimmed to its longest prompt and response; auto: as many as the "
        "process's memory affords, at most 16384 (hf_fsdp.fit); None: micro_batch_size chunks",
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="at most this many samples per forward/backward; None: no cap"
    )
    logits_budget_bytes: int = Field(
        DEFAULT_LOGITS_BUDGET_BYTES,
        ge=1,
        description="float32 logits the LM head may hold at once; a micro-batch whose logits "
        "exceed it computes log-probs and entropy in token chunks from the hidden states",
    )
    param_dtype: DTypeName = Field("float32", description="dtype of the sharded master weights")
    mixed_precision: Literal["auto", "none", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype; auto = bfloat16 on GPU, none on CPU (reduce in fp32)"
    )
    reshard_after_forward: bool = True
    fsdp_unit: Literal["auto", "layer", "model"] = Field(
        "auto",
        description="FSDP units: each decoder layer (bounds gathered memory), the whole "
        "model (fewest collectives), or auto: per layer from 100M parameters",
    )
    cpu_offload: bool = Field(
        False, description="FSDP2 CPUOffloadPolicy: shards live in host memory (GPU only)"
    )
    offload_params: bool = Field(True, description="offload() moves parameters to CPU")
    offload_optimizer: bool = Field(True, description="offload() moves optimiser state to CPU")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="recompute layer activations in the backward; auto: on when fewer than "
        "4096 tokens a micro-batch would fit without it (hf_fsdp.fit)",
    )
    disable_dropout: bool = Field(True, description="RL needs the same function in every pass")
    attn_implementation: str | None = Field(None, description="e.g. 'sdpa', 'eager'")
    shared_prefix: bool = Field(
        True,
        description="forwards lay out the samples of one prompt as one row, the prompt "
        "computed once (hf_core.engines.shared_prefix), where that costs less than plain rows",
    )
    sequence_packing: bool = Field(
        True,
        description="forwards lay a micro-batch's samples back to back in one row, no padding "
        "computed (hf_core.engines.sequence_packing), where that costs less than padded rows "
        "and shared_prefix did not pack it",
    )
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism (the recipe's <role>.parallel.sp): groups "
        "of this many ranks share one data chunk and split each micro-batch's tokens, "
        "attention running by heads after an all-to-all (hf_fsdp.ulysses); must divide the "
        "ranks and the model's attention heads",
    )
    cpu_linear: CPULinear = "onednn"
    cpu_collectives: Literal["shared_memory", "process_group"] = Field(
        "shared_memory",
        description="CPU ranks on one host: FSDP's all-gather and reduce-scatter copy through "
        "a /dev/shm file (hf_fsdp.cpu_shared_memory; gloo where ranks cannot share one), or "
        "process_group: always gloo.  GPUs use NCCL either way",
    )
    cpu_data_parallel: Literal["auto", "fsdp", "replicate", "leader"] = Field(
        "auto",
        description="CPU ranks' data-parallel strategy (hf_fsdp.data_parallel): auto and fsdp: "
        "FSDP2 shards, the path GPU runs take; replicate: plain replicas averaging their "
        "gradients through shared memory (hf_fsdp.data_parallel.cpu_replicas) when they fit "
        "in a quarter of the host's memory; leader: the host's first rank trains for every "
        "rank with every rank's threads, the others reading a shared-memory mirror of its "
        "weights (hf_fsdp.data_parallel.cpu_leader).  Where replicate or leader cannot run, "
        "FSDP2 shards; one CPU process trains a plain module unless fsdp is set; GPUs always "
        "use FSDP2",
    )
    lora: LoRAConfig | None = Field(
        None,
        description="train LoRA adapters (rank, alpha, dropout, target_modules) over frozen "
        "base weights instead of the whole model; None: full fine-tuning",
    )

    def state_bytes_per_rank(self, num_params: int, ranks: int, trainable: bool) -> int:
        """One rank's weights, gradients and Adam moments (``DeclaresTrainingState``) under
        the data-parallel strategy these settings resolve to
        (:func:`hf_fsdp.data_parallel.choice.state_bytes_per_rank`)."""
        from hf_core.device import resolve_device

        device = resolve_device(self.device)
        return choice.state_bytes_per_rank(self, device, num_params, ranks, trainable)

    def mixed_precision_dtype(self, device: torch.device) -> torch.dtype | None:
        """The compute dtype of FSDP's mixed-precision policy, or ``None`` for none
        (``auto``: bfloat16 on GPU, none on CPU)."""
        compute = self.mixed_precision
        if compute == "auto":
            compute = "bfloat16" if device.type == "cuda" else "none"
        return None if compute == "none" else to_dtype(compute)

    def node_shared_bytes(self, ranks_per_node: int) -> int:
        """The shared-memory collectives' file at its largest, when it is used
        (``DeclaresNodeSharedMemory``; CPU runs only reach the check that asks)."""
        if self.cpu_collectives != "shared_memory" or ranks_per_node < 2:
            return 0
        return SHARED_MEMORY_FILE_BYTES

    @field_validator("cpu_data_parallel", mode="before")
    @classmethod
    def _renamed_strategy(cls, value: object) -> object:
        refuse_renamed_value(value, {"pool": "leader"}, "cpu_data_parallel", POOL_MEANS_RESOURCES)
        return value

    @model_validator(mode="after")
    def _lora_needs_training(self) -> FSDPEngineConfig:
        if self.lora is not None and not self.trainable:
            raise ValueError("lora is set on a frozen engine (trainable=False): nothing to train")
        return self

    @model_validator(mode="after")
    def _micro_batches_are_bounded(self) -> FSDPEngineConfig:
        if self.max_tokens_per_micro_batch is None and self.micro_batch_size is None:
            raise ValueError(
                "set max_tokens_per_micro_batch or micro_batch_size: with neither, a whole "
                "batch would go through one forward"
            )
        return self

    @field_validator("max_tokens_per_micro_batch")
    @classmethod
    def _positive_tokens(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"must be >= 1, 'auto' or None, got {value}")
        return value

    @property
    def torch_param_dtype(self) -> torch.dtype:
        return to_dtype(self.param_dtype)


class TransformersRolloutConfig(BaseModel):
    """The transformers rollout engine: a plain (unsharded) model per rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path
    dtype: DTypeName | Literal["auto"] = Field(
        "auto",
        description="weights and products; auto: bfloat16 where the device computes it "
        "natively (CUDA GPUs with bfloat16, CPUs with AVX512-BF16 / AMX for models from 8M "
        "parameters), float32 elsewhere",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = Field(
        256, ge=1, description="sequences decoded together (vLLM's max_num_seqs default)"
    )
    attn_implementation: str | None = None
    cpu_linear: CPULinear = "onednn"
    decoder: Literal["auto", "transformers"] = Field(
        "auto",
        description="auto: the lean Llama-family decoder (llama, qwen2, mistral; "
        "hf_fsdp.decoder) where it applies, transformers' forward otherwise",
    )
    seed: int = Field(0, description="sampling seed when SamplingParams.seed is None")
    cpu_leader_generation: bool = Field(
        False,
        description="CPU ranks of one process group on one host decode every rank's prompts "
        "on the host's first rank with all their threads (hf_fsdp.cpu_leader_rollout): "
        "decoding reads every weight once a step instead of once per rank.  Every rank must "
        "then call generate together, as the single-turn rollout does: leave it off with an "
        "agent loop or the policy endpoint, whose ranks call it their own numbers of times "
        "(token streams always decode per rank)",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: object) -> object:
        refuse_renamed_keys(data, {"cpu_host_generation": "cpu_leader_generation"}, THE_LEADER)
        return data

    def routed_experts_unsupported(self) -> str | None:
        """The engine returns an MoE model's experts per token (``DeclaresRoutedExperts``;
        :mod:`hf_fsdp.moe_routing`), on any device."""
        return None


# Validation with errors naming key, value and expectation is core's (shared by backends).
parse_config = parse_engine_config


if not TYPE_CHECKING:  # type checkers keep flagging unknown names
    __getattr__ = renamed_attributes(
        __name__, {"HFRolloutConfig": "TransformersRolloutConfig"}, HF_MEANS_HYBRIDFLOW
    )
