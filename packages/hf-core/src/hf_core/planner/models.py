"""Models for the cost model by name, path or config: presets of the paper's models and
:func:`load_model`.

The shape itself (:class:`ModelSpec`, :func:`from_hf_config`) lives in
:mod:`hf_core.model_shapes`, below the engines that count with it too; it is re-exported here
for the planner's callers.  Every preset is a Llama-architecture shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_core.model_shapes import BF16_BYTES, ModelSpec, from_hf_config

__all__ = ["BF16_BYTES", "PRESETS", "ModelSpec", "from_hf_config", "load_model", "preset"]


def _llama(name: str, h: int, inter: int, layers: int, heads: int, kv: int) -> ModelSpec:
    """A Llama-2 family shape (vocabulary 32000, untied head)."""
    return ModelSpec(name, h, inter, layers, heads, kv, vocab_size=32000)


PRESETS: dict[str, ModelSpec] = {
    "llama2-7b": _llama("llama2-7b", 4096, 11008, 32, 32, 32),
    "llama2-13b": _llama("llama2-13b", 5120, 13824, 40, 40, 40),
    "codellama-34b": _llama("codellama-34b", 8192, 22016, 48, 64, 8),
    "llama2-70b": _llama("llama2-70b", 8192, 28672, 80, 64, 8),
}
"""Named shapes from the HuggingFace configs of the models the paper evaluates (§8.1)."""

_ALIASES = {
    "llama-2-7b": "llama2-7b",
    "llama-7b": "llama2-7b",
    "7b": "llama2-7b",
    "llama-2-13b": "llama2-13b",
    "llama-13b": "llama2-13b",
    "13b": "llama2-13b",
    "llama2-34b": "codellama-34b",
    "llama-34b": "codellama-34b",
    "34b": "codellama-34b",
    "llama-2-70b": "llama2-70b",
    "llama-70b": "llama2-70b",
    "70b": "llama2-70b",
}


def preset(name: str) -> ModelSpec:
    """Look a preset up by name or alias (case-insensitive); unknown names list the choices."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[key]


def load_model(
    source: ModelSpec | str | Path | Mapping[str, Any], *, base: Path | None = None
) -> ModelSpec:
    """Resolve a model from a spec, a preset name, a ``config.json`` path (file or folder,
    relative to ``base``) or an inline HF config dict."""
    if isinstance(source, ModelSpec):
        return source
    if isinstance(source, Mapping):
        return from_hf_config(source)
    text = str(source)
    path = Path(text)
    if base is not None and not path.is_absolute():
        path = base / path
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"model config {text!r} not found (looked at {path})")
        with path.open() as fh:
            return from_hf_config(json.load(fh), name=path.parent.name or path.stem)
    return preset(text)
