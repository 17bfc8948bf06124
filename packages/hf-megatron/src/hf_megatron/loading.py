"""Read a HuggingFace folder: its config, and exactly the tensor ranges a megatron rank needs.

Each rank reads only its own rows/columns of each tensor from the memory-mapped safetensors
files (``safe_open(...).get_slice``), so no rank materialises the whole model and loading
needs no collective.  A value / score head the folder lacks (a critic started from a causal
LM) is initialised from the seed, identically on every rank.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from hf_megatron.weight_mapping import SUPPORTED_ARCHITECTURES, HeadKind

log = logging.getLogger(__name__)

HEAD_TENSORS = ("score.weight", "score.bias")
"""Canonical tensors a head adds to the backbone; only these may be absent on disk."""


class ModelLoadError(ValueError):
    """The model folder exists but its weights do not fit the model asked for."""


def check_model_folder(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a HuggingFace model folder (no config.json)")
    return folder


def load_hf_config(folder: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def architecture_for(hf_config: Any, head: HeadKind) -> str:
    """The HF class name a folder of ``head`` kind is exported as."""
    family = hf_config.model_type
    prefix = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    suffix = {
        "lm": "ForCausalLM",
        "value": "ForTokenClassification",
        "score": "ForSequenceClassification",
    }
    name = prefix + suffix[head]
    assert SUPPORTED_ARCHITECTURES[name] == (family, head)
    return name


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors(.index.json)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


class FolderReader:
    """A :data:`hf_megatron.weight_mapping.Fetch` over a folder's safetensors files."""

    def __init__(
        self, folder: Path, *, seed: int = 0, init_std: float = 0.02, hidden_size: int = 0
    ) -> None:
        self.files = weight_files(folder)
        self._handles: dict[Path, Any] = {}
        self.seed, self.init_std, self.hidden_size = seed, init_std, hidden_size
        self.initialized: list[str] = []
        self._made: dict[str, torch.Tensor] = {}

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def __call__(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if name not in self.files:
            full = self._missing(name)
            return full if dim is None else full.narrow(dim, start, stop - start)
        view = self._handle(self.files[name]).get_slice(name)
        if dim is None:
            return view[:]
        index = [slice(None)] * len(view.get_shape())
        index[dim] = slice(start, stop)
        return view[tuple(index)]

    def _missing(self, name: str) -> torch.Tensor:
        if name not in HEAD_TENSORS:
            raise ModelLoadError(f"the model folder has no tensor {name!r}")
        if name not in self._made:
            gen = torch.Generator().manual_seed(self.seed)
            if name == "score.weight":
                made = torch.randn(1, self.hidden_size, generator=gen) * self.init_std
            else:
                made = torch.zeros(1)
            self._made[name] = made
            self.initialized.append(name)
            log.info("%s not in the folder: initialised from seed %d", name, self.seed)
        return self._made[name]
