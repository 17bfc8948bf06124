"""Move a FSDP2 model's shards, gradients and optimiser state between GPU and host memory.

Used between phases of an RL step (e.g. free the actor's GPU memory while the rollout engine
generates).  FSDP2 keeps parameters as sharded DTensors, so ``module.to(device)`` moves the
shards; FSDP2 re-registers them.  On a CPU-only engine there is nothing to move, but the
hand-over is still measured: the ``*_bytes`` functions count what a GPU run would move, so
the trainer logs the same number everywhere.  Bytes are this rank's (a DTensor's local shard).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` lives on ``device`` (``cuda`` matches any index, ``cuda:1`` one)."""
    here = tensor.device
    return here.type == device.type and device.index in (None, here.index)


def tensor_bytes(tensors: Iterable[torch.Tensor], away_from: torch.device | None = None) -> int:
    """Bytes of this rank's part of ``tensors``; with ``away_from``, only those that are not
    on that device already (what a move there would actually copy)."""
    total = 0
    for tensor in tensors:
        local = local_tensor(tensor)
        if away_from is None or not is_on(local, away_from):
            total += local.numel() * local.element_size()
    return total


def model_tensors(model: nn.Module, grads: bool = True) -> list[torch.Tensor]:
    """What ``model.to`` moves -- parameters (tied ones once) and buffers -- plus the
    gradients, which ``model.to`` leaves behind and :func:`move_model` moves itself."""
    params = list(model.parameters())
    tensors = [*params, *model.buffers()]
    if grads:
        tensors += [p.grad for p in params if p.grad is not None]
    return tensors


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimiser state :func:`move_optimizer` moves (AdamW's moments, not its ``step``)."""
    return [
        value
        for state in optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key != "step"
    ]


def model_bytes(model: nn.Module, grads: bool = True) -> int:
    """Bytes :func:`move_model` moves off a device holding the whole model (this rank's shards)."""
    return tensor_bytes(model_tensors(model, grads))


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes :func:`move_optimizer` moves off a device holding all the state."""
    return tensor_bytes(optimizer_tensors(optimizer))


def move_model(model: nn.Module, device: torch.device, grads: bool = True) -> int:
    """Move parameters, buffers (and gradients) to ``device``; returns the bytes moved."""
    moved = tensor_bytes(model_tensors(model, grads), away_from=device)
    model.to(device)
    if grads:
        for param in model.parameters():
            if param.grad is not None:
                param.grad = param.grad.to(device, non_blocking=True)
    return moved


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Move the optimiser state to ``device``; returns the bytes moved."""
    moved = tensor_bytes(optimizer_tensors(optimizer), away_from=device)
    for state in optimizer.state.values():
        for key, value in state.items():
            # AdamW keeps "step" on the CPU unless capturable; leave it where torch wants it.
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    return moved


class DryMoveCounter:
    """:func:`model_bytes` and :func:`optimizer_bytes` for a CPU-only engine's hand-overs,
    from sizes counted once: the model's tensors keep their shapes and the optimiser's state
    only appears (at the first step), so each hand-over need not walk every DTensor again
    (a few milliseconds per hand-over, several hand-overs per step, on a small model)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._module, self._optim = model, optimizer
        self._param_bytes: dict[nn.Parameter, int] | None = None
        self._static_bytes = 0
        self._optimizer_bytes: tuple[int, int] = (-1, 0)
        """(number of parameters with state, their bytes)"""

    def model(self) -> int:
        """Parameters, buffers and the gradients present now."""
        if self._param_bytes is None:
            self._param_bytes = {p: tensor_bytes([p]) for p in self._module.parameters()}
            self._static_bytes = tensor_bytes(model_tensors(self._module, grads=False))
        grads = sum(size for p, size in self._param_bytes.items() if p.grad is not None)
        return self._static_bytes + grads

    def optimizer(self) -> int:
        if self._optim is None:
            return 0
        entries, size = self._optimizer_bytes
        if entries != len(self._optim.state):
            entries, size = len(self._optim.state), optimizer_bytes(self._optim)
            self._optimizer_bytes = (entries, size)
        return size
