"""HybridFlow's vLLM rollout engine (hybrid mode: in-process, next to the training engine).

The engine is built by name through the plugin registry (``vllm``), so importing this package
imports neither vLLM nor transformers.  Where things are:

- ``hf_vllm.engine.VLLMRolloutEngine`` and ``hf_vllm.config.VLLMRolloutConfig``;
- ``hf_vllm.weights``: canonical (HF) tensors -> vLLM, in buckets, in place;
- ``hf_vllm.tp_slices``: vLLM's TP partition and loading this rank's TP slices (3D-HybridEngine);
- ``hf_vllm.parallel``: generation TP/DP inside the training ranks;
- ``hf_vllm.runtime``: importing vLLM (``VLLMNotInstalledError`` names the extra to install).
"""

__version__ = "0.1.0"
