"""HybridFlow plugin: registers the "sglang" rollout engine.

Loaded through the ``hybridflow.plugins`` entry point.  Importing this module never imports
SGLang (``hybridflow backends`` lists the plugin on machines without it); the factory imports
it when an engine is built and names the extra to install when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable

from hf_core.plugins import hookimpl
from hf_core.plugins.lazy import engine_factory

create_rollout_engine = engine_factory("hf_sglang.engine:SGLangRolloutEngine")


@hookimpl
def register_rollout_engines(register: Callable[..., None]) -> None:
    register("sglang", create_rollout_engine, config="hf_sglang.config:SGLangRolloutConfig")
