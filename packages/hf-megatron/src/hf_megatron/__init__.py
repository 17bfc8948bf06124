"""HybridFlow's megatron-core backend: TP/PP/DP training engine, its own HF <-> megatron
weight mapping, and the 3D-HybridEngine reshard to a generation layout.

Names are imported lazily so that loading the plugin (``hf_megatron.plugin``) does not pull in
megatron-core or transformers.
"""

from __future__ import annotations

from hf_core.plugins.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "MegatronEngine": "hf_megatron.engine",
    "MegatronEngineConfig": "hf_megatron.config",
    "MegatronRolloutConfig": "hf_megatron.config",
    "MegatronRolloutEngine": "hf_megatron.rollout",
    "EngineConfigError": "hf_megatron.config",
    "MegatronWeightMapping": "hf_megatron.weight_mapping",
    "ModelDims": "hf_megatron.weight_mapping",
    "RankPosition": "hf_megatron.weight_mapping",
    "CanonicalSlice": "hf_megatron.weight_mapping",
    "Resharder": "hf_megatron.reshard",
    "ReshardStats": "hf_megatron.reshard",
    "CheckpointError": "hf_megatron.checkpoint",
    "hybrid_sync": "hf_megatron.hybrid",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
