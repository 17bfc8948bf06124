"""Names engine configs share: parameter dtypes by name and the model head kinds."""

from __future__ import annotations

from typing import Literal

import torch

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
