"""HybridFlow plugin: registers the "fsdp" training engine and the "transformers" rollout engine.

Loaded through the ``hybridflow.plugins`` entry point.  Importing this module is cheap: the
factories import torch.distributed / transformers only when an engine is built.
"""

from __future__ import annotations

from collections.abc import Callable

from hf_core.plugins import hookimpl
from hf_core.plugins.lazy import engine_factory

create_training_engine = engine_factory("hf_fsdp.engine:FSDPEngine")
create_rollout_engine = engine_factory("hf_fsdp.rollout:TransformersRolloutEngine")


@hookimpl
def register_training_engines(register: Callable[..., None]) -> None:
    register(
        "fsdp",
        create_training_engine,
        config="hf_fsdp.config:FSDPEngineConfig",
        parallel=("sp",),
    )


@hookimpl
def register_rollout_engines(register: Callable[..., None]) -> None:
    register(
        "transformers", create_rollout_engine, config="hf_fsdp.config:TransformersRolloutConfig"
    )
