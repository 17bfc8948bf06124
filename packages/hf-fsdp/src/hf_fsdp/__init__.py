"""HybridFlow's FSDP2 training engine and HF-transformers rollout engine.

Names are imported lazily so that loading the plugin (``hf_fsdp.plugin``) does not pull in
transformers.
"""

from __future__ import annotations

from hf_core.plugins.lazy import lazy_exports

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
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
