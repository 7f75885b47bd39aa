"""The run configuration: nanotron's config schema, written in TOML.

`schema` holds the sections as small frozen attrs classes and the one cattrs converter that
structures TOML into them, rejecting unknown keys; `load` reads a file, applies `--set` overrides
and resolves paths relative to the TOML file; `checks` finds everything that can be found wrong
before any expensive work, naming the file, the stage and the key of each problem.
"""

from nanoflow.config.checks import hf_config_mismatches, unreached_stages, validate
from nanoflow.config.load import apply_override, load_config
from nanoflow.config.schema import (
    BUILDERS,
    CheckpointsArgs,
    Config,
    ConfigError,
    DataArgs,
    DatasetArgs,
    DatasetStageArgs,
    GeneralArgs,
    LoggingArgs,
    LRSchedulerArgs,
    ModelArgs,
    NanosetDatasetsArgs,
    OptimizerArgs,
    OptimizerFactoryArgs,
    ParallelismArgs,
    RopeScalingArgs,
    StageLRSchedulerArgs,
    TokenizerArgs,
    TokensArgs,
    converter,
)

__all__ = [
    "BUILDERS", "CheckpointsArgs", "Config", "ConfigError", "DataArgs", "DatasetArgs", "DatasetStageArgs",
    "GeneralArgs", "LRSchedulerArgs", "LoggingArgs", "ModelArgs", "NanosetDatasetsArgs", "OptimizerArgs",
    "OptimizerFactoryArgs", "ParallelismArgs", "RopeScalingArgs", "StageLRSchedulerArgs", "TokenizerArgs", "TokensArgs", "apply_override", "converter",
    "hf_config_mismatches", "load_config", "unreached_stages", "validate",
]
