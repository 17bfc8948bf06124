"""Offload a megatron engine's GPU memory to the host while the rollout engine runs (GPU only).

megatron's DDP keeps every parameter (and gradient) as a view into one contiguous buffer per
dtype.  Offloading copies each buffer to host memory and shrinks its storage to zero bytes;
onloading grows the storage back and copies the data in.  The parameter views keep pointing
at the same storage object, so nothing has to be re-wired.  A frozen engine (no DDP) moves
its module instead.  Optimiser state tensors (and fp32 main weights) move with ``.data``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hf_core.device import release_cached_memory

if TYPE_CHECKING:
    from hf_megatron.engine import MegatronEngine


def _ddp_buffers(engine: MegatronEngine) -> list[Any]:
    ddp = getattr(engine, "_ddp", None)
    if ddp is None:
        return []
    return list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))


def _move_optimizer(engine: MegatronEngine, device: torch.device) -> None:
    from hf_megatron.checkpoint import sub_optimizers

    for sub in sub_optimizers(engine.optimizer):
        _move_inner(sub.optimizer, device)


def _move_inner(inner: torch.optim.Optimizer, device: torch.device) -> None:
    for group in inner.param_groups:
        for param in group["params"]:
            if param.untyped_storage().size() and param.device != device:
                param.data = param.data.to(device, non_blocking=True)
    for state in inner.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[key] = value.to(device, non_blocking=True)


def offload_engine(engine: MegatronEngine) -> None:
    buffers = _ddp_buffers(engine)
    if not buffers:
        engine.module.to("cpu")
    for buf in buffers:
        buf._hf_param_host = buf.param_data.detach().to("cpu")
        buf._hf_param_bytes = buf.param_data.untyped_storage().size()
        buf.param_data.untyped_storage().resize_(0)
        buf._hf_grad_bytes = buf.grad_data.untyped_storage().size()
        buf.grad_data.untyped_storage().resize_(0)
    _move_optimizer(engine, torch.device("cpu"))
    release_cached_memory(engine.device)


def onload_engine(engine: MegatronEngine) -> None:
    buffers = _ddp_buffers(engine)
    if not buffers:
        engine.module.to(engine.device)
    for buf in buffers:
        buf.param_data.untyped_storage().resize_(buf._hf_param_bytes)
        buf.param_data.copy_(buf._hf_param_host, non_blocking=True)
        buf.grad_data.untyped_storage().resize_(buf._hf_grad_bytes)
        buf.grad_data.zero_()
        del buf._hf_param_host
    _move_optimizer(engine, engine.device)
    torch.cuda.synchronize()
