"""LoRA on the FSDP engine: peft adapters injected before sharding, merged on export.

peft's ``inject_adapter_in_model`` runs on the ``meta`` model, before ``fully_shard``, so the
adapters are sharded like every other parameter and the base weights are still read from the
folder rank by rank (:mod:`hf_fsdp.loading`); only the adapters, which the folder does not
hold, are initialised here (peft's rule: ``A`` Kaiming-uniform, ``B`` zero, so a fresh
adapter changes nothing), from the seed and the tensor's name, identically on every rank.
peft marks only the adapters trainable; a value or score head is made trainable too.

peft names a wrapped layer's weight ``<module>.base_layer.weight`` and its adapters
``<module>.lora_A.default.weight``: the canonical names drop ``base_layer`` and the adapter
name (see :func:`canonical_lora_name`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hf_core.engines import LoRAConfig, NamedTensor, is_adapter_name
from hf_core.engines.adapters import adapted_module, merge_adapter
from hf_core.errors import ModelLoadError

ADAPTER_NAME = "default"


def inject_lora(model: nn.Module, config: LoRAConfig, trainable_heads: tuple[str, ...]) -> None:
    """Wrap the target linear layers of ``model`` (on ``meta``) with LoRA adapters in place;
    only the adapters and the modules named in ``trainable_heads`` keep ``requires_grad``."""
    from peft import LoraConfig, inject_adapter_in_model

    peft_config = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
    )
    try:
        inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER_NAME)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ModelLoadError(
            f"lora.target_modules={list(config.target_modules)}: {exc}; name the model's "
            "linear layers (e.g. q_proj, v_proj)"
        ) from None
    for name in trainable_heads:
        head = getattr(model, name, None)
        if head is not None:
            head.requires_grad_(True)


def canonical_lora_name(name: str) -> str:
    """peft names to canonical: ``x.base_layer.weight`` -> ``x.weight``,
    ``x.lora_A.default.weight`` -> ``x.lora_A.weight``."""
    parts = name.split(".")
    out: list[str] = []
    for i, part in enumerate(parts):
        if part == "base_layer":
            continue
        if part == ADAPTER_NAME and i > 0 and parts[i - 1] in ("lora_A", "lora_B"):
            continue
        out.append(part)
    return ".".join(out)


def init_adapter_tensor(name: str, shape: torch.Size, seed: int) -> torch.Tensor | None:
    """A new adapter tensor (peft's init: ``A`` Kaiming-uniform, ``B`` zero), the same on every
    rank; ``None`` when ``name`` is not an adapter."""
    if not is_adapter_name(name):
        return None
    tensor = torch.zeros(shape)
    if name.endswith(".lora_A.weight"):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
    return tensor


def tuner_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Every LoRA layer computes its base layer only; afterwards the adapters are back (with
    ``requires_grad`` as before: peft's switch freezes them while disabled)."""
    layers = tuner_layers(model)
    trainable = {id(p): p.requires_grad for layer in layers for p in layer.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
            for p in layer.parameters():
                p.requires_grad_(trainable[id(p)])


def adapted_weights(canonical_names: list[str]) -> frozenset[str]:
    """Canonical names of the base weights that have adapters (``m.weight`` for each ``m``
    with a ``m.lora_A.weight``)."""
    return frozenset(
        f"{adapted_module(n)}.weight" for n in canonical_names if n.endswith(".lora_A.weight")
    )


def merged(
    stream: Iterator[NamedTensor], scaling: float, adapted: frozenset[str]
) -> Iterator[NamedTensor]:
    """The canonical stream with each adapted weight (``adapted``) replaced by
    ``W + scaling * B @ A`` and the adapter tensors left out.  peft registers a layer's base
    weight before its adapters, so only one layer's tensors wait here at a time."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        if name in adapted:
            module, part = name[: -len(".weight")], "W"
        elif is_adapter_name(name):
            module = adapted_module(name)
            part = "A" if name.endswith(".lora_A.weight") else "B"
        else:
            yield name, tensor
            continue
        parts = waiting.setdefault(module, {})
        parts[part] = tensor
        if len(parts) == 3:
            del waiting[module]
            yield f"{module}.weight", merge_adapter(parts["W"], parts["A"], parts["B"], scaling)
    if waiting:
        raise RuntimeError(f"LoRA merge: incomplete layers {sorted(waiting)[:3]}")
