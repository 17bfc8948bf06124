"""Run configuration: typed schema, YAML + dotted overrides, readable errors."""

from hf_core.config.loader import (
    ConfigError,
    EngineConfigError,
    describe_fields,
    load_config,
    parse_engine_config,
    validate,
)
from hf_core.config.schema import (
    AlgorithmConfig,
    ClusterConfig,
    DataConfig,
    JudgeConfig,
    KLConfig,
    ModelConfig,
    ModelRoleConfig,
    ParallelConfig,
    PlacementConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "EngineConfigError",
    "JudgeConfig",
    "KLConfig",
    "ModelConfig",
    "ModelRoleConfig",
    "ParallelConfig",
    "PlacementConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "TrainerConfig",
    "describe_fields",
    "load_config",
    "parse_engine_config",
    "validate",
]
