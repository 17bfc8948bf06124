"""Read a HuggingFace folder: its config, and exactly the tensor ranges a megatron rank needs.

Each rank reads only its own rows/columns of each tensor from the memory-mapped safetensors
files (``safe_open(...).get_slice``), so no rank materialises the whole model and loading
needs no collective.  A value / score head the folder lacks (a critic started from a causal
LM) is initialised from the seed, identically on every rank.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from hf_core.engines import HeadKind, check_model_folder, weight_files  # noqa: F401  (re-exported)
from hf_core.errors import ModelLoadError
from hf_megatron.weight_mapping import SUPPORTED_ARCHITECTURES

log = logging.getLogger(__name__)

HEAD_TENSORS = ("score.weight", "score.bias")
"""Canonical tensors a head adds to the backbone; only these may be absent on disk."""


def load_hf_config(folder: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def architecture_for(hf_config: Any, head: HeadKind) -> str:
    """The HF class name a folder of ``head`` kind is exported as."""
    family = hf_config.model_type
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3_moe": "Qwen3Moe"}[family]
    suffix = {
        "lm": "ForCausalLM",
        "value": "ForTokenClassification",
        "score": "ForSequenceClassification",
    }
    name = prefix + suffix[head]
    assert SUPPORTED_ARCHITECTURES[name] == (family, head)
    return name


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
