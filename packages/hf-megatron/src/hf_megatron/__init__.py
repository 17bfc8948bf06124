"""HybridFlow's megatron-core backend: TP/PP/DP training engine, its own HF <-> megatron
weight mapping, and the 3D-HybridEngine reshard to a generation layout.

Engines are built by name through the plugin registry (``megatron``), so importing this
package imports neither megatron-core nor transformers.  Where things are:

- ``hf_megatron.engine.MegatronEngine`` and ``hf_megatron.config.MegatronEngineConfig``;
- ``hf_megatron.rollout.MegatronRolloutEngine``: TP generation (the CPU stand-in for a TP
  rollout backend);
- ``hf_megatron.weight_mapping``: megatron <-> canonical (HF) names and TP slices;
- ``hf_megatron.reshard`` and ``hf_megatron.hybrid``: the 3D-HybridEngine transition;
- ``hf_megatron._cpu_compat``: the CPU-only compatibility layer (applied only without CUDA).
"""

__version__ = "0.1.0"
