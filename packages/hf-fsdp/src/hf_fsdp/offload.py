"""Move a FSDP2 model's shards, gradients and optimiser state between GPU and host memory.

Used between phases of an RL step (e.g. free the actor's GPU memory while the rollout engine
generates).  FSDP2 keeps parameters as sharded DTensors, so ``module.to(device)`` moves the
shards; FSDP2 re-registers them.  On a CPU-only engine there is nothing to move.
"""

from __future__ import annotations

import torch
from torch import nn


def move_model(model: nn.Module, device: torch.device, grads: bool = True) -> None:
    model.to(device)
    if grads:
        for param in model.parameters():
            if param.grad is not None:
                param.grad = param.grad.to(device, non_blocking=True)


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            # AdamW keeps "step" on the CPU unless capturable; leave it where torch wants it.
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
