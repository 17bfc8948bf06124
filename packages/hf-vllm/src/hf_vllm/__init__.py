"""HybridFlow's vLLM rollout engine (hybrid mode: in-process, next to the training engine).

Names are imported lazily so that loading the plugin (``hf_vllm.plugin``) imports neither
vLLM nor transformers.
"""

from __future__ import annotations

from hf_core.plugins.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "VLLMRolloutEngine": "hf_vllm.engine",
    "VLLMRolloutConfig": "hf_vllm.config",
    "EngineConfigError": "hf_vllm.config",
    "GenerationRank": "hf_core.engines",
    "SyncStats": "hf_core.engines",
    "VLLMSyncStats": "hf_vllm.weights",
    "sync_weights": "hf_vllm.weights",
    "VLLMNotInstalledError": "hf_vllm.runtime",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
