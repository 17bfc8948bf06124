"""HybridFlow plugin: registers the "sglang" rollout engine.

Loaded through the ``hybridflow.backends`` entry point.  Importing this module never imports
SGLang (``hybridflow backends`` lists the plugin on machines without it); the factory imports
it when an engine is built and names the extra to install when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_core.plugins import hookimpl


def create_rollout_engine(**config: Any) -> Any:
    """``SGLangRolloutEngine`` from keyword config (see ``SGLangRolloutConfig``).

    SGLang is imported here, not when the plugin loads."""
    from hf_sglang.engine import SGLangRolloutEngine

    return SGLangRolloutEngine(config)


@hookimpl
def register_rollout_engines(register: Callable[[str, Any], None]) -> None:
    register("sglang", create_rollout_engine)
