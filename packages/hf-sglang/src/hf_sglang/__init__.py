"""HybridFlow's SGLang rollout engine (hybrid mode: an offline ``sglang.Engine`` per actor rank).

Names are imported lazily so that loading the plugin (``hf_sglang.plugin``) imports neither
SGLang nor transformers.
"""

from __future__ import annotations

from hf_core.plugins.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "SGLangRolloutEngine": "hf_sglang.engine",
    "SGLangRolloutConfig": "hf_sglang.config",
    "EngineConfigError": "hf_sglang.config",
    "SGLangNotInstalledError": "hf_sglang.runtime",
    "SGLangSyncStats": "hf_sglang.weights",
    "SyncStats": "hf_core.engines",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
