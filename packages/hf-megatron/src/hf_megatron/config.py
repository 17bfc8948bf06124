"""Typed configuration of the megatron training engine and the megatron rollout engine.

The keys shared with hf-fsdp's ``FSDPEngineConfig`` (``model_path``, ``head``, ``trainable``,
the optimiser and schedule keys, ``param_dtype``, ``device``, ``seed``,
``export_dtype``) mean exactly the same thing, so a recipe switches backend by changing the
engine name and adding the parallel sizes.  Both models use ``extra="forbid"``: a misspelt key
fails loudly, and :func:`parse_config` reports every problem at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hf_core.config import EngineConfigError, parse_engine_config  # noqa: F401  (re-exported)
from hf_core.engines import (  # noqa: F401  (HeadKind, to_dtype re-exported)
    DTypeName,
    HeadKind,
    TrainingEngineConfig,
    to_dtype,
)


class MegatronEngineConfig(TrainingEngineConfig):
    """Everything one megatron training engine (any role) needs.

    The model, optimiser, schedule and placement keys are core's
    :class:`~hf_core.engines.TrainingEngineConfig` (the same meaning as on hf-fsdp).  The
    data-parallel size is not configured: it is ``world_size / (tp * pp)`` of the process
    group the engine runs in (megatron's rank order ``tp-dp-pp``).
    """

    micro_batch_size: int = Field(
        8, ge=1, description="samples per forward/backward (pipeline schedules need one size)"
    )

    # parallelism
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="ep: experts of a mixture-of-experts model split over this many ranks of "
        "the data-parallel axis (must divide the experts and world / (tp * pp))",
    )
    sequence_parallel: bool = Field(False, description="GPU + Transformer Engine spec only")
    layer_spec: Literal["auto", "local", "transformer_engine"] = Field(
        "auto", description="auto = Transformer Engine on GPU when installed, else local"
    )
    make_vocab_size_divisible_by: int | None = Field(
        None,
        ge=1,
        description="vocab padded to a multiple of this times the TP size; None: 64 / TP "
        "(pads to 64 like vLLM, so generation TP slices line up), or 128 if TP does not divide 64",
    )
    use_distributed_optimizer: bool = Field(True, description="shard optimiser state over DP")
    weight_decay_scope: Literal["all", "matrices"] = Field(
        "all", description="all params (as hf-fsdp) or megatron's rule: no decay on biases/norms"
    )
    param_dtype: DTypeName = Field("float32", description="dtype of the model weights")

    @model_validator(mode="after")
    def _sequence_parallel_has_its_spec(self) -> MegatronEngineConfig:
        if self.sequence_parallel and self.layer_spec == "local":
            raise ValueError("sequence_parallel needs the Transformer Engine layer spec")
        return self

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def state_bytes_per_rank(self, num_params: int, ranks: int, trainable: bool) -> int:
        """One rank's weights, gradients and optimizer state, as the engine builds them
        (:class:`~hf_core.engines.DeclaresTrainingState`): weights in ``param_dtype`` split
        over TP x PP only (replicated over DP); a float32 gradient buffer beside them
        (``grad_reduce_in_fp32``); Adam's two float32 moments, plus float32 master weights
        for 16-bit parameters, split over DP as well with the distributed optimizer."""
        shard = num_params // self.model_parallel_size
        width = to_dtype(self.param_dtype).itemsize
        if not trainable:
            return width * shard
        data_parallel = max(1, ranks // self.model_parallel_size)
        optimizer_shard = shard // data_parallel if self.use_distributed_optimizer else shard
        master = 4 if width < 4 else 0  # float32 weights are their own master copy
        return width * shard + 4 * shard + (8 + master) * optimizer_shard


class MegatronRolloutConfig(BaseModel):
    """The megatron rollout engine: generation with tensor parallelism over a process group.

    It is the CPU stand-in for a TP rollout backend in the 3D-HybridEngine (vLLM is the
    product path on GPU): it loads the TP slices a reshard produces without gathering them
    further.  Greedy or sampled decoding recomputes the whole sequence every step (no KV
    cache), so it is meant for tests and small models.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path
    dtype: DTypeName = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = Field(64, ge=1, description="sequences decoded together")
    tensor_parallel_size: int = Field(
        1, ge=1, description="t_g: consecutive ranks forming one engine (set by the trainer)"
    )
    make_vocab_size_divisible_by: int | None = Field(
        None, ge=1, description="as the training engine's (None: 64 / TP, or 128)"
    )
    padded_vocab_size: int | None = Field(
        None, description="the training engine's padded vocabulary, so TP slices line up"
    )
    seed: int = Field(0, description="sampling seed when SamplingParams.seed is None")


# Validation with errors naming key, value and expectation is core's (shared by backends).
parse_config = parse_engine_config
