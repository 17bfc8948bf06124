"""The LoRA adapters a vLLM engine generates with: peft folders vLLM's ``LoRARequest`` loads.

vLLM loads an adapter from a folder by its integer id, lazily at the first request that names
it.  Each sync writes the actor's adapters to a new folder with a new id (so vLLM never serves
a cached older one) in a private temporary directory; the folder before it is kept until the
next sync (vLLM may still be reading it), older ones are deleted.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from hf_core.engines import LoRAConfig, NamedTensor, write_peft_folder


class AdapterFolders:
    """The latest adapter of one engine, as a folder and a ``LoRARequest`` for it."""

    def __init__(self, base_model: Path) -> None:
        self.base_model = base_model
        self._root: Path | None = None
        self._folders: list[Path] = []
        self._request: Any = None
        self.version = 0

    def write(self, config: LoRAConfig, tensors: list[NamedTensor]) -> Path:
        from vllm.lora.request import LoRARequest

        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="hf-vllm-lora-"))
        self.version += 1
        folder = write_peft_folder(
            self._root / f"v{self.version}", config, tensors, base_model=self.base_model
        )
        self._request = LoRARequest(f"actor-v{self.version}", self.version, str(folder))
        self._folders.append(folder)
        while len(self._folders) > 2:
            shutil.rmtree(self._folders.pop(0), ignore_errors=True)
        return folder

    def request(self) -> Any:
        """The ``LoRARequest`` of the latest adapter, or ``None`` (base weights) before one."""
        return self._request

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
