"""Build a FSDP2-sharded HuggingFace model from a local folder without a full copy per rank.

Strategy (chosen over "rank 0 loads, then broadcasts each tensor"): every rank

1. builds the model with its parameters on the ``meta`` device (no memory; buffers such as the
   rotary ``inv_freq`` are computed for real, they are tiny and not in the checkpoint),
2. applies ``fully_shard`` to each decoder layer and to the root, which turns every parameter
   into a dim-0-sharded DTensor whose local shard is still on ``meta``,
3. allocates its local shards (``to_empty``), and
4. reads *only its own rows* of each tensor from the memory-mapped safetensors files
   (``safe_open(...).get_slice(name)[rows]``).

So a rank holds its shard plus one tensor slice at a time, and loading needs no collective:
no rank ever materialises the full model, and rank 0 is not a bottleneck.  Parameters the
folder lacks are allowed only for a head the folder's model did not have (a critic or reward
model started from a causal LM); they are initialised from ``seed`` identically on all ranks.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hf_core.engines import check_model_folder, weight_files  # noqa: F401  (re-exported)
from hf_core.engines.model_classes import causal_lm_class
from hf_core.errors import ModelLoadError
from hf_fsdp.config import FSDPEngineConfig, HeadKind
from hf_fsdp.fused_experts import expert_names, expert_slices, is_fused
from hf_fsdp.lora import init_adapter_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

HEAD_MODULES: dict[HeadKind, tuple[str, ...]] = {
    "lm": (),
    "value": ("score",),
    "score": ("score",),
}
"""Top-level modules a head kind adds to the backbone; only these may be absent on disk."""


class SafetensorsReader:
    """Reads slices of named tensors from a folder's safetensors files (memory-mapped)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files = weight_files(folder)
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._handles.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._handles:
            if not path.is_file():
                raise FileNotFoundError(f"{path} (listed in the weight index) is missing")
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._handle(name).get_slice(name)[index]


def load_hf_config(cfg: FSDPEngineConfig, folder: Path) -> PretrainedConfig:
    """The folder's config, adjusted for the head kind and for RL (no dropout)."""
    from transformers import AutoConfig

    overrides: dict[str, Any] = {}
    if cfg.head in ("value", "score"):
        overrides["num_labels"] = 1
    hf_config = AutoConfig.from_pretrained(folder, **overrides)
    if cfg.disable_dropout:
        for key in ("attention_dropout", "hidden_dropout", "classifier_dropout", "dropout"):
            if hasattr(hf_config, key):
                setattr(hf_config, key, 0.0)
        hf_config.classifier_dropout = 0.0
    if cfg.head == "score" and getattr(hf_config, "pad_token_id", None) is None:
        # transformers' sequence classifier refuses batches > 1 without one (we pick the
        # scored token ourselves anyway).
        hf_config.pad_token_id = getattr(hf_config, "eos_token_id", None) or 0
    return hf_config


def model_class(head: HeadKind, hf_config: PretrainedConfig) -> Any:
    """The transformers auto class for a head kind (a vision-language model's for ``lm`` when
    the config has a vision tower)."""
    import transformers

    if head == "lm":
        return causal_lm_class(hf_config)
    name = {
        "lm": "AutoModelForCausalLM",
        "value": "AutoModelForTokenClassification",
        "score": "AutoModelForSequenceClassification",
    }[head]
    return getattr(transformers, name)


def build_empty_model(cfg: FSDPEngineConfig, hf_config: PretrainedConfig) -> nn.Module:
    """The model with parameters on ``meta`` and real buffers."""
    from accelerate import init_empty_weights

    kwargs: dict[str, Any] = {"dtype": cfg.torch_param_dtype}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    with init_empty_weights(include_buffers=False):
        model = model_class(cfg.head, hf_config).from_config(hf_config, **kwargs)
    # init_empty_weights re-creates each parameter on meta, which unties shared ones.
    model.tie_weights()
    if cfg.disable_dropout:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    if cfg.gradient_checkpointing is True:  # "auto" decides at the first update (hf_fsdp.fit)
        enable_gradient_checkpointing(model)
    return model


def set_gradient_checkpointing(model: nn.Module, on: bool) -> None:
    """Turn recompute on or off for the next passes (numbers are the same either way)."""
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    if on and not any(getattr(m, "_gradient_checkpointing_func", None) for m in layers):
        enable_gradient_checkpointing(model)
        return
    for layer in layers:
        layer.gradient_checkpointing = on


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant, so FSDP's
    hooks run again in the recompute); only layer inputs are kept.  Works before or after
    sharding: transformers only flags the layers."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP wraps one by one: those HF marks as not to be split (decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ModelLoadError(
            f"{type(model).__name__} declares no _no_split_modules; cannot find its decoder "
            "layers to shard one by one"
        )
    return layers


PER_LAYER_MIN_PARAMS = 100_000_000
"""``fsdp_unit: auto`` shards layer by layer from this model size on."""


def shards_per_layer(model: nn.Module, cfg: FSDPEngineConfig) -> bool:
    """Whether each decoder layer is its own FSDP unit.

    Per-layer units bound the gathered memory to about one layer, which large models need; each
    unit also costs a collective per forward and backward.  Below :data:`PER_LAYER_MIN_PARAMS`
    the whole model gathered is small, and one unit made a tiny model's update faster on 2 CPU
    ranks (gloo latency per collective dominates; docs/performance.md, "Measured choices").
    """
    if cfg.fsdp_unit != "auto":
        return cfg.fsdp_unit == "layer"
    return sum(p.numel() for p in model.parameters()) >= PER_LAYER_MIN_PARAMS


def shard_model(
    model: nn.Module, mesh: DeviceMesh, cfg: FSDPEngineConfig, device: torch.device
) -> None:
    """``fully_shard`` per decoder layer (see :func:`shards_per_layer`), then the root
    (embeddings, norm, head, and the layers when they are not sharded on their own)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    compute = cfg.mixed_precision_dtype(device)
    mp = MixedPrecisionPolicy()
    if compute is not None:
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    offload: OffloadPolicy = OffloadPolicy()
    if cfg.cpu_offload:
        if device.type == "cuda":
            offload = CPUOffloadPolicy(pin_memory=True)
        else:
            log.info("cpu_offload ignored: the model already lives in CPU memory")
    layers = decoder_layers(model) if shards_per_layer(model, cfg) else []
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            reshard_after_forward=cfg.reshard_after_forward,
            mp_policy=mp,
            offload_policy=offload,
        )
    # The root stays gathered between forward and backward (it is needed first in backward);
    # forward-only passes reshard it explicitly (see engine).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)


def local_index(param: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the full tensor that this rank's shard of ``param`` holds."""
    shape = list(param.shape)
    offsets = [0] * len(shape)
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        for mesh_dim, placement in enumerate(param.placements):
            if placement.is_shard():
                dim = placement.dim  # type: ignore[attr-defined]
                parts, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
                chunk = math.ceil(shape[dim] / parts)  # torch.chunk semantics, as FSDP2 uses
                start = min(rank * chunk, shape[dim])
                offsets[dim] += start
                shape[dim] = min(start + chunk, shape[dim]) - start
        local = param.to_local()
        if tuple(local.shape) != tuple(shape):
            raise RuntimeError(
                f"unexpected shard placements {param.placements}: local shape {tuple(local.shape)}"
                f" but computed {tuple(shape)}"
            )
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


@contextmanager
def _keep_buffers(model: nn.Module, device: torch.device) -> Iterator[None]:
    """``to_empty`` wipes buffers too; put the (tiny, computed) buffers back afterwards, on
    the compute device (FSDP manages parameters only, even when it keeps them on the host)."""
    saved = {
        (id(module), name): buf.detach().clone()
        for module in model.modules()
        for name, buf in module._buffers.items()
        if buf is not None and not buf.is_meta
    }
    yield
    for module in model.modules():
        for name, buf in module._buffers.items():
            key = (id(module), name)
            if key in saved and buf is not None:
                module._buffers[name] = saved[key].to(device)


@contextmanager
def _keep_tied_parameters(model: nn.Module) -> Iterator[None]:
    """``to_empty`` on a plain (unsharded) module gives each module its own new tensor, so
    weights shared under two names (a tied LM head) come apart; share them again after."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties: list[tuple[nn.Module, str, nn.Module, str]] = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first:
                ties.append((module, name, *first[id(param)]))
            else:
                first[id(param)] = (module, name)
    yield
    for module, name, owner, owner_name in ties:
        module._parameters[name] = owner._parameters[owner_name]


@dataclass
class LoadReport:
    """What loading did, for logs and tests."""

    loaded: list[str] = field(default_factory=list)
    initialized: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)


def canonical_candidates(name: str, base_prefix: str) -> list[str]:
    """Checkpoint names a parameter may be stored under (with or without the base prefix)."""
    names = [name]
    prefix = f"{base_prefix}." if base_prefix else ""
    if prefix and name.startswith(prefix):
        names.append(name[len(prefix) :])
    elif prefix:
        names.append(prefix + name)
    return names


def _load_fused_experts(
    model: nn.Module, reader: SafetensorsReader, name: str, param: torch.Tensor, used: set[str]
) -> bool:
    """Fill this rank's experts of a fused expert parameter from the checkpoint's per-expert
    tensors (:mod:`hf_fsdp.fused_experts`); False when ``name`` is not one."""
    if not is_fused(name):
        return False
    names = expert_names(str(getattr(model.config, "model_type", "")))
    first = local_index(param)[0].start
    slices = expert_slices(name, _local(param), names, first) or []
    for key, view in slices:
        if key not in reader:
            raise ModelLoadError(f"expert tensor {key!r} of {name} is not in the checkpoint")
        view.copy_(reader.read(key, tuple(slice(None) for _ in view.shape)))
        used.add(key)
    return True


def _init_head_tensor(name: str, shape: torch.Size, std: float, seed: int) -> torch.Tensor:
    """A new head weight, the same on every rank (seeded by ``seed`` and the name)."""
    if name.endswith("bias") or len(shape) < 2:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def materialize_and_load(
    model: nn.Module,
    folder: Path,
    head: HeadKind,
    device: torch.device,
    seed: int,
    param_names: dict[str, str],
    shard_device: torch.device | None = None,
) -> LoadReport:
    """Allocate each rank's shards and fill them from the folder's safetensors files.

    With FSDP2's CPU offload policy the shards must live in host memory: pass the CPU as
    ``shard_device``; buffers still go to ``device``.
    """
    report = LoadReport()
    base_prefix = getattr(model, "base_model_prefix", "")
    std = float(getattr(model.config, "initializer_range", 0.02))
    head_modules = HEAD_MODULES[head]
    with _keep_buffers(model, device), _keep_tied_parameters(model):
        model.to_empty(device=shard_device or device)
    with SafetensorsReader(folder) as reader:
        used: set[str] = set()
        missing: list[str] = []
        for native, param in model.named_parameters():
            canonical = param_names[native]
            index = local_index(param)
            candidates = canonical_candidates(canonical, base_prefix)
            key = next((k for k in candidates if k in reader), None)
            if key is None and _load_fused_experts(model, reader, canonical, param, used):
                report.loaded.append(canonical)
                continue
            if key is None:
                adapter = init_adapter_tensor(canonical, param.shape, seed)
                if adapter is not None:  # LoRA: not in the base folder, new from the seed
                    _local(param).copy_(adapter[index])
                    report.adapters.append(canonical)
                    continue
                if canonical.split(".")[0] in head_modules:
                    full = _init_head_tensor(canonical, param.shape, std, seed)
                    _local(param).copy_(full[index])
                    report.initialized.append(canonical)
                    continue
                missing.append(canonical)
                continue
            on_disk = reader.shape(key)
            if on_disk != tuple(param.shape):
                raise ModelLoadError(
                    f"{folder}: tensor {key!r} has shape {on_disk} on disk but the "
                    f"{type(model).__name__} built from config.json expects {tuple(param.shape)}"
                )
            _local(param).copy_(reader.read(key, index))
            used.add(key)
            report.loaded.append(canonical)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ModelLoadError(
                f"{folder}: {len(missing)} parameter(s) of {type(model).__name__} are not in the "
                f"folder's safetensors files: {shown}"
            )
        report.unused = sorted(set(reader.files) - used)
    if report.initialized:
        log.warning(
            "%s: new %s head weights initialised from seed %d: %s",
            folder,
            head,
            seed,
            report.initialized,
        )
    return report
