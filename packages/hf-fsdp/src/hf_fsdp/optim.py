"""AdamW, the warm-up + decay learning-rate schedule, and global-norm gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from hf_fsdp.config import FSDPEngineConfig


def build_optimizer(params: Iterable[nn.Parameter], cfg: FSDPEngineConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, in torch's fused kernel (CPU and CUDA): one pass
    over all parameters instead of a handful of small ops per tensor (much faster on the
    tiny models the CPU tests train; docs/performance.md, "Measured choices")."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=True,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: FSDPEngineConfig) -> LambdaLR:
    # A closure (not a callable object): LambdaLR then saves no schedule parameters in its
    # state dict, so a resumed run follows its *current* config.
    def factor(step: int) -> float:
        return cfg.lr_factor(step)  # core's shared warm-up + decay rule

    schedule: Callable[[int], float] = factor
    return LambdaLR(optimizer, schedule)


def clip_grad_norm(
    params: Iterable[nn.Parameter],
    max_norm: float | None,
    device: torch.device,
    across_ranks: bool = True,
) -> float:
    """Global L2 norm of the gradients over all ranks; clip to ``max_norm`` if given.

    FSDP2 gradients are dim-0 shards (every element lives on exactly one rank), so the global
    squared norm is the all-reduced sum of the local shards' squared norms.  Doing this on the
    local tensors, rather than through DTensor ops, also works when FSDP's CPU offload keeps
    the gradients in host memory while the process group is nccl-only.  Plain (non-DTensor)
    gradients are the same on every rank (replicas: counted once), or, without
    ``across_ranks``, this process's alone (the leader under leader training, which holds every
    gradient while the others wait: no collective).  Same formula as
    ``torch.nn.utils.clip_grad_norm_``: scale by ``max_norm / (norm + 1e-6)`` when below 1.
    """
    grads = [p.grad for p in params if p.grad is not None]
    reduce = across_ranks and dist.is_initialized()
    world = dist.get_world_size() if reduce else 1
    squares = torch.zeros((), dtype=torch.float32, device=device)
    locals_: list[torch.Tensor] = []
    for grad in grads:
        if isinstance(grad, DTensor):
            if not all(p.is_shard() for p in grad.placements):
                raise NotImplementedError(f"gradient placements {grad.placements} (not FSDP)")
            local, share = grad.to_local(), 1.0
        else:  # replicated on every rank: count it once overall
            local, share = grad, 1.0 / world
        # one read of the gradient (``pow(2).sum()`` wrote a squared copy of every gradient),
        # accumulated in float32 whatever the gradient dtype
        norm = torch.linalg.vector_norm(local, dtype=torch.float32).to(device)
        squares += norm.square() * share
        locals_.append(local)
    if reduce:
        dist.all_reduce(squares)
    total = float(squares.sqrt())
    if max_norm is not None and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for local in locals_:
                local.mul_(coef)
    return total
