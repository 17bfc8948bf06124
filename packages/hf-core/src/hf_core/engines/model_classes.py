"""Which transformers class loads a causal-LM folder, and the names its parameters are saved
under.

A vision-language model (a config with ``vision_config``, e.g. Qwen2-VL) is a causal LM with
a vision tower, but transformers registers it under ``AutoModelForImageTextToText``, not
``AutoModelForCausalLM``.  Its module tree also differs from its checkpoint: transformers
renames ``model.layers.*`` to ``model.language_model.layers.*`` (and ``visual.*`` to
``model.visual.*``) when it loads, and back when it saves.  The canonical names every backend
exchanges are the checkpoint's (what vLLM and SGLang load), so engines translate with
:func:`checkpoint_names`, which asks transformers' own save-time reversal instead of copying
its renaming rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hf_core.engines.hf_folder import read_model_config
from hf_core.errors import EngineConfigError
from hf_core.multimodal import is_vision_model


def causal_lm_class(config: Any) -> Any:
    """The transformers auto class that builds a causal LM from ``config``."""
    import transformers

    if is_vision_model(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def checkpoint_names(model: Any, names: Iterable[str]) -> dict[str, str]:
    """``{module name: checkpoint name}`` for ``names`` (parameter names of ``model``).

    Identity for models transformers loads without renaming (Llama, Qwen2, ...).  A name the
    reversal does not map one-to-one (a fused or split tensor) keeps its module name.
    """
    names = list(names)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5 loads checkpoints without renaming
        return {name: name for name in names}
    # shaped meta tensors: a fused tensor's reversal splits it (MoE experts), which an empty
    # sentinel cannot take; meta tensors cost no memory
    shapes = {n: t.shape for n, t in model.named_parameters(remove_duplicate=False)}
    shapes.update((n, b.shape) for n, b in model.named_buffers(remove_duplicate=False))
    sentinels = {name: torch.empty(shapes.get(name, (0,)), device="meta") for name in names}
    reverted = revert_weight_conversion(model, dict(sentinels))
    by_tensor = {id(tensor): saved for saved, tensor in reverted.items()}
    return {name: by_tensor.get(id(tensor), name) for name, tensor in sentinels.items()}


def checkpoint_shapes(model: Any, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """``{checkpoint name: shape}`` of what ``save_pretrained`` writes for the parameters
    ``names`` of ``model``: the names of :func:`checkpoint_names`, and a fused tensor as the
    tensors it was fused from (transformers 5's mixture-of-experts layers: one per expert
    projection).  Computed on meta tensors: no memory."""
    params = dict(model.named_parameters(remove_duplicate=False))
    shapes = {name: tuple(params[name].shape) for name in names}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5 saves modules as they are
        return shapes
    sentinels = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    reverted = revert_weight_conversion(model, sentinels)
    return {name: tuple(tensor.shape) for name, tensor in reverted.items()}


def refuse_vision_model(folder: Path, backend: str, why: str) -> None:
    """An :class:`~hf_core.errors.EngineConfigError` naming the model and what to use
    instead, before a backend that cannot run a vision-language model starts building it."""
    config = read_model_config(folder)
    if not is_vision_model(config):
        return
    architecture = ", ".join(config.get("architectures") or ["?"])
    raise EngineConfigError(
        f"{folder} is a vision-language model ({architecture}); the {backend} backend does "
        f"not run one: {why} (docs/vlm.md)"
    )
