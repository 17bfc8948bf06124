"""Names engine configs share: parameter dtypes by name and the model head kinds."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from hf_core.device import inference_dtype
from hf_core.engines.hf_folder import read_model_config
from hf_core.model_shapes import from_hf_config

DTypeName = Literal["float32", "bfloat16", "float16"]

HeadKind = Literal["lm", "value", "score"]
"""``lm``: causal LM (actor, reference); ``value``: per-token value (critic);
``score``: one scalar per sequence (reward and cost models)."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def to_dtype(name: str) -> torch.dtype:
    """The torch dtype for one of the :data:`DTypeName` strings."""
    return _DTYPES[name]


def rollout_dtype(name: str, model_folder: Path, device: torch.device) -> torch.dtype:
    """A rollout engine's ``dtype`` setting as a torch dtype: ``auto`` resolves for the model in
    ``model_folder`` on ``device`` (:func:`hf_core.device.inference_dtype`), other names as
    named."""
    if name != "auto":
        return to_dtype(name)
    return inference_dtype(device, _num_params(model_folder))


def _num_params(folder: Path) -> int | None:
    """The model's parameter count from its ``config.json`` (``None`` where the shape count,
    :mod:`hf_core.model_shapes`, does not know the architecture)."""
    try:
        return from_hf_config(read_model_config(folder)).num_params
    except (KeyError, ValueError, TypeError, OSError):
        return None
