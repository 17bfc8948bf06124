"""HybridFlow plugin: registers the "vllm" rollout engine.

Loaded through the ``hybridflow.plugins`` entry point.  Importing this module never imports
vLLM (``hybridflow backends`` lists the plugin on machines without it); the factory imports it
when an engine is built and says which extra to install when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable

from hf_core.plugins import hookimpl
from hf_core.plugins.lazy import engine_factory

create_rollout_engine = engine_factory("hf_vllm.engine:VLLMRolloutEngine")


@hookimpl
def register_rollout_engines(register: Callable[..., None]) -> None:
    register(
        "vllm", create_rollout_engine, config="hf_vllm.config:VLLMRolloutConfig", parallel=("tp",)
    )
