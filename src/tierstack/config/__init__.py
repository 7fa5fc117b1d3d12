"""Configuration: section dataclasses, the container, overrides and validation."""

from tierstack.config.container import ConfigContainer, ConfigError
from tierstack.config.sections import (
    CheckpointConfig,
    DatasetConfig,
    DistributedConfig,
    LoggerConfig,
    MlflowConfig,
    ModelConfig,
    OptimizerConfig,
    ProfileConfig,
    ResiliencyConfig,
    RNGConfig,
    SchedulerConfig,
    StragglerConfig,
    TokenizerConfig,
    TrainConfig,
    WandbConfig,
)

__all__ = [
    "CheckpointConfig",
    "ConfigContainer",
    "ConfigError",
    "DatasetConfig",
    "DistributedConfig",
    "LoggerConfig",
    "MlflowConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ProfileConfig",
    "ResiliencyConfig",
    "RNGConfig",
    "SchedulerConfig",
    "StragglerConfig",
    "TokenizerConfig",
    "TrainConfig",
    "WandbConfig",
]
