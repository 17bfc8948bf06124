"""HybridFlow's FSDP2 training engine and transformers rollout engine.

Engines are built by name through the plugin registry (``fsdp``, ``transformers``), so importing
this package imports nothing heavy.  Where things are:

- ``hf_fsdp.engine.FSDPEngine`` and ``hf_fsdp.config.FSDPEngineConfig``: the training engine;
- ``hf_fsdp.rollout.TransformersRolloutEngine`` and ``hf_fsdp.config.TransformersRolloutConfig``:
  the rollout engine (``HFRolloutEngine`` / ``HFRolloutConfig`` before ``hf`` meant HybridFlow
  alone: those names are refused, naming these);
- ``hf_fsdp.export.FSDPWeightMapping``: FSDP <-> canonical (HF) names;
- ``hf_fsdp.loading``, ``hf_fsdp.checkpoint``, ``hf_fsdp.optim``, ``hf_fsdp.offload``: the parts.
"""

__version__ = "0.1.0"
