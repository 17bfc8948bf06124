"""HybridFlow plugin: registers the "fsdp" training engine and the "hf" rollout engine.

Loaded through the ``hybridflow.backends`` entry point.  Importing this module is cheap: the
factories import torch.distributed / transformers only when an engine is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_core.plugins import hookimpl


def create_training_engine(**config: Any) -> Any:
    """``FSDPEngine`` from keyword config (see :class:`hf_fsdp.config.FSDPEngineConfig`)."""
    from hf_fsdp.engine import FSDPEngine

    return FSDPEngine(config)


def create_rollout_engine(**config: Any) -> Any:
    """``HFRolloutEngine`` from keyword config (see :class:`hf_fsdp.config.HFRolloutConfig`)."""
    from hf_fsdp.rollout import HFRolloutEngine

    return HFRolloutEngine(config)


@hookimpl
def register_training_engines(register: Callable[[str, Any], None]) -> None:
    register("fsdp", create_training_engine)


@hookimpl
def register_rollout_engines(register: Callable[[str, Any], None]) -> None:
    register("hf", create_rollout_engine)
