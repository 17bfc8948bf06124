"""HybridFlow plugin: registers the "vllm" rollout engine.

Loaded through the ``hybridflow.backends`` entry point.  Importing this module never imports
vLLM (``hybridflow backends`` lists the plugin on machines without it); the factory imports it
when an engine is built and says which extra to install when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_core.plugins import hookimpl


def create_rollout_engine(**config: Any) -> Any:
    """``VLLMRolloutEngine`` from keyword config (see :class:`hf_vllm.config.VLLMRolloutConfig`)."""
    from hf_vllm.engine import VLLMRolloutEngine

    return VLLMRolloutEngine(config)


@hookimpl
def register_rollout_engines(register: Callable[[str, Any], None]) -> None:
    register("vllm", create_rollout_engine)
