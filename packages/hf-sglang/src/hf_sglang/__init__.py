"""HybridFlow's SGLang rollout engine (hybrid mode: an offline ``sglang.Engine`` per actor rank).

The engine is built by name through the plugin registry (``sglang``), so importing this
package imports neither SGLang nor transformers.  Where things are:

- ``hf_sglang.engine.SGLangRolloutEngine`` and ``hf_sglang.config.SGLangRolloutConfig``;
- ``hf_sglang.weights``: canonical (HF) tensors -> SGLang, from tensors or over a process group;
- ``hf_sglang.runtime``: importing SGLang (``SGLangNotInstalledError`` names the extra).
"""

__version__ = "0.1.0"
