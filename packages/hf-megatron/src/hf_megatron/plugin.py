"""HybridFlow plugin: registers the "megatron" training engine and rollout engine.

Loaded through the ``hybridflow.plugins`` entry point.  Importing this module is cheap: the
factories import megatron-core only when an engine is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_core.plugins import hookimpl
from hf_core.plugins.lazy import engine_factory

create_training_engine = engine_factory("hf_megatron.engine:MegatronEngine")
ENGINE_CONFIG = "hf_megatron.config:MegatronEngineConfig"
ROLLOUT_CONFIG = "hf_megatron.config:MegatronRolloutConfig"


def create_rollout_engine(**config: Any) -> Any:
    """``MegatronRolloutEngine`` (TP generation; the CPU stand-in for a TP rollout backend).

    ``plan`` (a core ``ReshardPlan``) may be passed among the keywords to place the engine
    on the generation mesh of the 3D-HybridEngine.
    """
    from hf_megatron.rollout import MegatronRolloutEngine

    plan = config.pop("plan", None)
    return MegatronRolloutEngine(config, plan=plan)


@hookimpl
def register_training_engines(register: Callable[..., None]) -> None:
    register("megatron", create_training_engine, config=ENGINE_CONFIG, parallel=("tp", "pp", "ep"))


@hookimpl
def register_rollout_engines(register: Callable[..., None]) -> None:
    register("megatron", create_rollout_engine, config=ROLLOUT_CONFIG, parallel=("tp",))
