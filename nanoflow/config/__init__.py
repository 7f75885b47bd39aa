"""The run configuration: nanotron's config schema, written in TOML.

`schema` (with `stages` for [[data_stages]] and [evaluation], and `rope` for the rope_scaling table and the
RoPE each stage trains with) holds the sections as small frozen attrs classes, each key declared with its
meaning (`keys`; `reference` renders them as docs/config.md); `structure` is the one cattrs converter that
structures TOML into them, rejecting unknown keys; `load` reads a file, applies `--set` overrides and
resolves paths relative to the TOML file, and completes a fresh [model] (`families`: the model families,
their defaults and switches; an HF init_from's config.json completes it instead, read by
nanoflow.preflight); `checks` (with `model_checks` and `data_checks`) finds everything that can be found
wrong before any expensive work, naming the file, the stage and the key of each problem.
"""

from nanoflow.config.checks import (
                                    MODEL_KEYS,
                                    check_world_size,
                                    complete_model,
                                    locate_source,
                                    model_changes,
                                    model_from_hf,
                                    recorded_model,
                                    recorded_stage_ropes,
                                    trained_rope,
                                    unreached_stages,
                                    untrained_splits,
                                    validate,
)
from nanoflow.config.families import FAMILIES, Architecture, hf_config
from nanoflow.config.load import apply_override, config_from_dict, load_config
from nanoflow.config.locations import Location, matching_files, token_folder_problem
from nanoflow.config.rope import Rope, stage_rope
from nanoflow.config.schema import (
                                    BUILDERS,
                                    CheckpointsArgs,
                                    Config,
                                    ConfigError,
                                    DataArgs,
                                    DatasetArgs,
                                    DatasetStageArgs,
                                    EvalDatasetArgs,
                                    EvaluationArgs,
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
)
from nanoflow.config.structure import converter

__all__ = [
    "BUILDERS", "CheckpointsArgs", "Config", "ConfigError", "DataArgs", "DatasetArgs", "DatasetStageArgs",
    "EvalDatasetArgs", "EvaluationArgs",
    "GeneralArgs", "LRSchedulerArgs", "LoggingArgs", "ModelArgs", "NanosetDatasetsArgs", "OptimizerArgs",
    "OptimizerFactoryArgs", "ParallelismArgs", "RopeScalingArgs", "StageLRSchedulerArgs", "TokenizerArgs", "TokensArgs",
    "apply_override", "Architecture", "check_world_size", "complete_model", "config_from_dict", "converter",
    "FAMILIES", "hf_config", "model_from_hf", "recorded_model", "Location", "locate_source", "MODEL_KEYS", "matching_files", "model_changes", "load_config",
    "Rope", "recorded_stage_ropes", "stage_rope", "trained_rope",
    "token_folder_problem", "unreached_stages", "untrained_splits", "validate",
]
