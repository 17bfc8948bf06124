"""FSDP <-> canonical weights: the name mapping and the streamed export.

FSDP2 trains the HuggingFace module itself, so the mapping is nearly the identity: it strips
wrapper path components (``torch.compile``'s ``_orig_mod``, FSDP1 / activation-checkpoint
wrappers, DDP's leading ``module``) and follows HF's tied weights: with
``tie_word_embeddings`` the model has one tensor for ``model.embed_tokens.weight`` and
``lm_head.weight``; it is exported once, under the embedding's name, as ``save_pretrained``
does.  A rollout engine loading a tied model updates both through that one tensor.

The stream gathers parameters a bucket at a time: the ranks' dim-0 shards of every parameter
in the bucket travel in one all-gather (a per-parameter ``DTensor.full_tensor()`` costs one
collective round trip each, which dominated a small model's sync).  It is a collective:
every rank must iterate the stream to the end, in the same order (``named_parameters()``
order is the same on every rank).  At most one gathered bucket is alive at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hf_core.engines import NamedTensor, WeightMapping
from hf_core.engines.model_classes import checkpoint_names
from hf_fsdp import cpu_shared_memory
from hf_fsdp.fused_experts import ExpertNames, expert_names, expert_slices
from hf_fsdp.lora import canonical_lora_name
from hf_fsdp.moe_routing import moe_routers

WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def canonical_name(native: str) -> str:
    """The HF name of a (possibly wrapped) module parameter; a LoRA-wrapped layer's weight
    keeps its HF name, its adapters are ``<module>.lora_A.weight`` / ``lora_B.weight``."""
    parts = [p for p in native.split(".") if p not in WRAPPER_COMPONENTS]
    if parts and parts[0] == "module":  # DistributedDataParallel
        parts = parts[1:]
    return canonical_lora_name(".".join(parts))


def canonical_names(model: nn.Module) -> dict[str, str]:
    """``{native: canonical}`` for every parameter name (tied aliases included): wrappers
    stripped (:func:`canonical_name`), then the checkpoint's name where transformers renames
    modules on load (vision-language models: :func:`~hf_core.engines.model_classes.
    checkpoint_names`)."""
    stripped = {
        native: canonical_name(native)
        for native, _ in model.named_parameters(remove_duplicate=False)
    }
    saved = checkpoint_names(model, set(stripped.values()))
    return {native: saved[name] for native, name in stripped.items()}


class FSDPWeightMapping(WeightMapping):
    """Native (module) names <-> canonical HF names for one FSDP model.  A mixture of
    experts' fused expert parameters go out as the checkpoint's per-expert tensors
    (:mod:`hf_fsdp.fused_experts`)."""

    def __init__(self, model: nn.Module, names: Mapping[str, str] | None = None) -> None:
        """``names``: :func:`canonical_names` taken before sharding (transformers does not
        recognise a sharded model's class, so it would not rename)."""
        self.to_hf: dict[str, str] = {}
        self.tied: dict[str, str] = {}
        """Canonical alias -> canonical name of the tensor it shares (e.g. lm_head -> embed)."""
        first_of: dict[int, str] = {}
        names = dict(names) if names is not None else canonical_names(model)
        for native, param in model.named_parameters(remove_duplicate=False):
            name = names[native]
            if id(param) in first_of:
                self.tied[name] = first_of[id(param)]
                continue
            first_of[id(param)] = name
            self.to_hf[native] = name
        self.from_hf = {hf: native for native, hf in self.to_hf.items()}
        self.experts: ExpertNames | None = None
        if moe_routers(model):
            self.experts = expert_names(str(getattr(model.config, "model_type", "")))

    def canonical(self, native: str, tensor: torch.Tensor) -> Iterator[NamedTensor]:
        """``native``'s full tensor under its canonical name, or a fused expert tensor as
        one tensor per expert projection (copies: a view would carry the whole storage)."""
        name = self.to_hf[native]
        slices = expert_slices(name, tensor, self.experts) if self.experts else None
        if slices is None:
            yield name, tensor
            return
        for expert, view in slices:
            yield expert, view.clone()

    def to_canonical(self, native: Mapping[str, torch.Tensor]) -> Iterator[NamedTensor]:
        for name, tensor in native.items():
            if name in self.to_hf:
                yield from self.canonical(name, full_tensor(tensor))

    def from_canonical(self, canonical: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
        for name, tensor in canonical:
            name = self.tied.get(name, name)
            if name not in self.from_hf:
                raise KeyError(f"{name!r} is not a parameter of this model")
            yield self.from_hf[name], tensor


def full_tensor(param: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The whole tensor on every rank (a collective for DTensors); detached."""
    if not isinstance(param, DTensor):
        return param.detach()
    local = param.to_local()
    if param.device_mesh.size() == 1 and local.shape == param.shape:
        # one rank holds the whole tensor: no redistribute (DTensor dispatch per tensor was
        # most of a small model's one-process weight sync)
        return (local.to(device) if device is not None else local).detach()
    if device is not None and local.device != device:  # shard kept in host memory
        param = DTensor.from_local(
            local.to(device),
            param.device_mesh,
            param.placements,
            shape=param.shape,
            stride=param.stride(),
        )
    return param.full_tensor().detach()


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers that are part of the state dict (rotary caches and the like are not)."""
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


@torch.no_grad()
def stream_canonical(
    model: nn.Module,
    mapping: FSDPWeightMapping,
    *,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 64 * 2**20,
    only: Callable[[str], bool] | None = None,
) -> Iterator[NamedTensor]:
    """Every canonical ``(name, full tensor)`` of the model, gathered ``bucket_bytes`` of
    full tensors at a time (parameters not sharded on dim 0 go alone).  ``only`` (a test of
    the canonical name, the same on every rank) keeps a subset and leaves out the buffers."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for native, param in model.named_parameters():
        if only is not None and not only(mapping.to_hf[native]):
            continue
        if not _dim0_sharded(param):
            yield from _gathered(pending, mapping, device, dtype)
            pending, size = [], 0
            tensor = full_tensor(param, device)
            yield from mapping.canonical(native, tensor.to(dtype) if dtype is not None else tensor)
            continue
        nbytes = param.numel() * param.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield from _gathered(pending, mapping, device, dtype)
            pending, size = [], 0
        pending.append((native, param))
        size += nbytes
    yield from _gathered(pending, mapping, device, dtype)
    if only is not None:
        return
    for native, buf in persistent_buffers(model):
        yield canonical_name(native), buf.detach().clone()


def _dim0_sharded(param: torch.Tensor) -> bool:
    """FSDP2's sharding over several ranks: a DTensor on a 1-D mesh, sharded along dim 0.

    On one rank the local shard is the whole tensor (``full_tensor`` runs no collective); a gloo
    all-gather there only costs time, and once a large one has run, this process's
    multi-threaded decoding was measured slower for the rest of its life (docs/performance.md,
    "Measured choices").
    """
    if not isinstance(param, DTensor) or param.device_mesh.ndim != 1 or param.ndim == 0:
        return False
    if param.device_mesh.size() == 1:
        return False
    (placement,) = param.placements
    return placement.is_shard() and placement.dim == 0  # type: ignore[attr-defined]


def _gathered(
    params: list[tuple[str, torch.Tensor]],
    mapping: FSDPWeightMapping,
    device: torch.device | None,
    dtype: torch.dtype | None,
) -> Iterator[NamedTensor]:
    """Full tensors of dim-0-sharded DTensors, with one all-gather for all of them.

    Rank ``r`` holds rows ``[r c, (r + 1) c)`` of each parameter (``c = ceil(rows / world)``,
    ``torch.chunk`` semantics; trailing ranks may hold fewer or none): every rank pads its
    shards to ``c`` rows, so all send the same shapes and each full tensor is the ranks'
    pieces, unpadded, concatenated.
    """
    if not params:
        return
    first = params[0][1]
    assert isinstance(first, DTensor)
    mesh = first.device_mesh
    world, group = mesh.size(), mesh.get_group()
    chunks: list[int] = []
    send: list[torch.Tensor] = []
    for _, param in params:
        assert isinstance(param, DTensor)
        local = param.to_local()
        if device is not None and local.device != device:  # shard kept in host memory
            local = local.to(device)
        rows = -(-param.shape[0] // world)
        padded = local.new_zeros((rows, *param.shape[1:]))
        padded[: local.shape[0]] = local
        chunks.append(rows)
        send.append(padded.reshape(-1))
    flat = torch.cat(send)
    gathered = flat.new_empty(world * flat.numel())
    cpu_shared_memory.all_gather_into(gathered, flat, group)
    pieces = gathered.chunk(world)
    offset = 0
    for (native, param), rows, part in zip(params, chunks, send, strict=True):
        numel = part.numel()
        shards = [p[offset : offset + numel].view(rows, *param.shape[1:]) for p in pieces]
        tensor = torch.cat(shards)[: param.shape[0]]
        offset += numel
        yield from mapping.canonical(native, tensor.to(dtype) if dtype is not None else tensor)
