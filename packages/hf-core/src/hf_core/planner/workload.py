"""The per-iteration workload: how many sequences of what length each stage processes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Workload(BaseModel):
    """One RLHF iteration's batch shape (the paper's §8.1 setting is the default).

    ``mini_batches`` is the number of optimizer steps per PPO epoch; micro-batch sizes are in
    sequences and set pipeline depth and activation memory.  The last two fields are how the
    training engine runs (Megatron-style): they change memory and compute, not the batch.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    global_batch: int = Field(1024, ge=1, description="prompts per iteration")
    prompt_length: int = Field(1024, ge=1)
    response_length: int = Field(1024, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    mini_batches: int = Field(4, ge=1, description="optimizer steps per epoch")
    samples_per_prompt: int = Field(1, ge=1)
    micro_batch_size: int = Field(1, ge=1, description="sequences per training micro-batch")
    inference_micro_batch_size: int = Field(8, ge=1)
    activation_recompute: Literal["selective", "full"] = "selective"
    distributed_optimizer: bool = Field(True, description="shard Adam states over DP ranks")

    @property
    def sequence_length(self) -> int:
        """Prompt plus response: what every forward and backward pass sees."""
        return self.prompt_length + self.response_length

    def sequences(self, extra_per_prompt: int = 0) -> int:
        """Sequences an operation touches (rollouts per prompt times prompts)."""
        return self.global_batch * (self.samples_per_prompt + extra_per_prompt)

    @property
    def tokens(self) -> int:
        """Tokens per iteration as the paper counts throughput (prompt + response)."""
        return self.sequences() * self.sequence_length
