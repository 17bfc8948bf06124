"""Offload a megatron engine's GPU memory to the host while the rollout engine runs (GPU only).

megatron's DDP keeps every parameter (and gradient) as a view into one contiguous buffer per
dtype.  Offloading copies each buffer to host memory and shrinks its storage to zero bytes;
onloading grows the storage back and copies the data in.  The parameter views keep pointing
at the same storage object, so nothing has to be re-wired.  A frozen engine (no DDP) moves
its module instead.  Optimiser state tensors (and fp32 main weights) move with ``.data``.

Both directions return the bytes they free on / bring back to the device (buffers count in
full: a gradient buffer is dropped and re-zeroed rather than copied, but its memory is handed
over all the same).  On a CPU-only engine nothing moves; :func:`resident_bytes` counts what a
GPU run would move, so the hand-over is measured the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """``cuda`` matches any index, ``cuda:1`` only itself."""
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def _inner_optimizers(engine: MegatronEngine) -> list[torch.optim.Optimizer]:
    from hf_megatron.checkpoint import sub_optimizers

    return [sub.optimizer for sub in sub_optimizers(engine.optimizer)]


def _own_params(inner: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimiser's parameters that have memory of their own: fp32 main weights.  Model
    parameters (views into a DDP buffer, which move with it) have none while it is
    offloaded; :func:`resident_bytes` tells them apart by storage instead."""
    return [
        p for group in inner.param_groups for p in group["params"] if p.untyped_storage().size()
    ]


def _state_tensors(inner: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Adam's moments (a scalar ``step`` stays where it is)."""
    return [
        value
        for state in inner.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.dim() > 0
    ]


def _move_optimizer(engine: MegatronEngine, device: torch.device) -> int:
    return sum(_move_inner(inner, device) for inner in _inner_optimizers(engine))


def _move_inner(inner: torch.optim.Optimizer, device: torch.device) -> int:
    moved = 0
    for param in _own_params(inner):
        if not _is_on(param, device):
            moved += _nbytes(param)
            param.data = param.data.to(device, non_blocking=True)
    for state in inner.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                moved += 0 if _is_on(value, device) else _nbytes(value)
                state[key] = value.to(device, non_blocking=True)
    return moved


def _module_bytes(module: torch.nn.Module) -> int:
    """What ``module.to`` moves: parameters (tied ones once) and buffers."""
    return sum(_nbytes(t) for t in [*module.parameters(), *module.buffers()])


def resident_bytes(engine: MegatronEngine) -> int:
    """The bytes :func:`offload_engine` would move from a device holding everything: the
    DDP buffers (parameters, gradients) or a frozen module, and the optimiser's own tensors
    (fp32 main weights that do not alias a DDP buffer, Adam's moments)."""
    buffers = _ddp_buffers(engine)
    if not buffers:
        return _module_bytes(engine.module)
    total = 0
    in_buffers = set()
    for buf in buffers:
        for data in (buf.param_data, buf.grad_data):
            total += data.untyped_storage().nbytes()
            in_buffers.add(data.untyped_storage().data_ptr())
    for inner in _inner_optimizers(engine):
        own = [p for p in _own_params(inner) if p.untyped_storage().data_ptr() not in in_buffers]
        total += sum(_nbytes(t) for t in [*own, *_state_tensors(inner)])
    return total


def offload_engine(engine: MegatronEngine) -> int:
    """Free the engine's device memory into host copies (GPU); the bytes freed."""
    moved = _move_engine(engine, torch.device("cpu"), _offload_buffer)
    release_cached_memory(engine.device)
    return moved


def onload_engine(engine: MegatronEngine) -> int:
    """Undo :func:`offload_engine`; the bytes brought back to the device."""
    moved = _move_engine(engine, engine.device, _onload_buffer)
    torch.cuda.synchronize()
    return moved


def _move_engine(
    engine: MegatronEngine, device: torch.device, move_buffer: Callable[[Any], int]
) -> int:
    """What both directions do, in order: a frozen engine's module moves whole, each DDP
    buffer through ``move_buffer`` (which returns its bytes), then the optimiser's tensors."""
    buffers = _ddp_buffers(engine)
    moved = 0
    if not buffers:
        moved += _module_bytes(engine.module)
        engine.module.to(device)
    moved += sum(move_buffer(buf) for buf in buffers)
    return moved + _move_optimizer(engine, device)


def _offload_buffer(buf: Any) -> int:
    """Copy a DDP buffer's parameters to the host and shrink both its storages to nothing."""
    buf._hf_param_host = buf.param_data.detach().to("cpu")
    buf._hf_param_bytes = buf.param_data.untyped_storage().size()
    buf.param_data.untyped_storage().resize_(0)
    buf._hf_grad_bytes = buf.grad_data.untyped_storage().size()
    buf.grad_data.untyped_storage().resize_(0)
    return buf._hf_param_bytes + buf._hf_grad_bytes


def _onload_buffer(buf: Any) -> int:
    """Grow a DDP buffer's storages back, copy its parameters in and zero its gradients."""
    buf.param_data.untyped_storage().resize_(buf._hf_param_bytes)
    buf.param_data.copy_(buf._hf_param_host, non_blocking=True)
    buf.grad_data.untyped_storage().resize_(buf._hf_grad_bytes)
    buf.grad_data.zero_()
    del buf._hf_param_host
    return buf._hf_param_bytes + buf._hf_grad_bytes
