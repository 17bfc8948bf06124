"""HybridFlow's FSDP2 training engine and HF-transformers rollout engine.

Names are imported lazily so that loading the plugin (``hf_fsdp.plugin``) does not pull in
transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "FSDPEngine": "hf_fsdp.engine",
    "FSDPEngineConfig": "hf_fsdp.config",
    "HFRolloutConfig": "hf_fsdp.config",
    "EngineConfigError": "hf_fsdp.config",
    "HFRolloutEngine": "hf_fsdp.rollout",
    "FSDPWeightMapping": "hf_fsdp.export",
    "CheckpointError": "hf_fsdp.checkpoint",
    "ModelLoadError": "hf_fsdp.loading",
    "build_tiny_model": "hf_testing.tiny",
    "build_tokenizer": "hf_testing.tiny",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hf_fsdp' has no attribute {name!r}")
