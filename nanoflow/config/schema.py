"""The schema: nanotron's config sections as small frozen attrs classes, and the one cattrs converter.

Field names follow nanotron so a nanotron YAML translates key for key, with HF LlamaConfig names
in [model]. The converter rejects unknown keys and lossy coercions.
"""

from __future__ import annotations

import json
import math
import os
from typing import Literal, Union

import attrs
import cattrs
from attrs import Factory, field, frozen
from attrs.validators import ge, gt, instance_of, le, lt, optional

from nanoflow.config.locations import BUILDERS
from nanoflow.errors import ConfigError  # noqa: F401 - imported from here



positive = [instance_of(int), gt(0)]
non_negative = [instance_of(int), ge(0)]
positive_float = [instance_of((int, float)), gt(0)]
unit_interval = [instance_of((int, float)), ge(0), lt(1)]   # Adam's betas: 1 would never forget, > 1 diverge
INT_LIMIT = 1 << 63   # every integer must fit torch's and numpy's int64


@frozen
class GeneralArgs:
    project: str = "nanoflow"
    run: str = "run"
    seed: int = 42


@frozen
class RopeScalingArgs:
    """[model.rope_scaling]: HF's rope_scaling (rope_parameters), for the RoPE types nanoflow implements.

    "linear" divides every frequency by `factor`; "llama3" (Llama 3.1+) divides the low frequencies by
    `factor`, keeps the high ones and blends in between. The types and the keys each needs are
    nanoflow.config.checks.ROPE_KEYS.
    """

    rope_type: str = "default"
    factor: Union[float, None] = field(default=None, validator=optional(positive_float))
    low_freq_factor: Union[float, None] = field(default=None, validator=optional(positive_float))
    high_freq_factor: Union[float, None] = field(default=None, validator=optional(positive_float))
    original_max_position_embeddings: Union[int, None] = field(default=None, validator=optional(positive))


@frozen
class ModelArgs:
    """A Llama decoder, in HF LlamaConfig names, plus how to train it."""

    vocab_size: int = field(validator=[*positive, le(1 << 32)])   # token files hold ids as uint32 at most
    hidden_size: int = field(validator=positive)
    intermediate_size: int = field(validator=positive)
    num_hidden_layers: int = field(validator=positive)
    num_attention_heads: int = field(validator=positive)
    num_key_value_heads: int = field(
        default=Factory(lambda self: self.num_attention_heads, takes_self=True), validator=positive)
    max_position_embeddings: int = field(default=2048, validator=positive)
    rms_norm_eps: float = field(default=1e-5, validator=positive_float)
    rope_theta: float = field(default=10000.0, validator=positive_float)
    rope_scaling: Union[RopeScalingArgs, None] = None   # None: plain RoPE, as {rope_type = "default"}
    tie_word_embeddings: bool = False
    initializer_range: float = field(default=0.02, validator=positive_float)
    dtype: Literal["float32", "bfloat16"] = "float32"   # autocast dtype; master weights stay float32
    compile: bool = False                              # torch.compile each decoder layer
    init_from: Union[str, None] = None                 # start from these weights (a checkpoint or HF folder)


@frozen
class TokenizerArgs:
    # "bytes" (the built-in byte tokenizer), a tokenizer.json, or an HF model / tokenizer folder holding one
    tokenizer_name_or_path: str = "bytes"
    # The end-of-text token every document ends with, and the BOS an export declares; unset: the folder's
    # tokenizer_config.json, else a special token with a common spelling (<|endoftext|>, </s>, ...).
    eos_token: Union[str, None] = None
    bos_token: Union[str, None] = None
    # Tokenizer names recorded in token folders (.ds.metadata) that cannot be resolved here (a hub name, a path
    # on another machine) and are to be taken as this tokenizer; each acceptance is logged.
    accept_recorded_names: Union[list[str], None] = None


@frozen
class ParallelismArgs:
    dp: int = field(default=1, validator=positive)
    tp: int = field(default=1, validator=positive)
    # nanotron's names: REDUCE_SCATTER is sequence parallelism (norms and residual stream split by position over tp)
    tp_mode: Literal["ALL_REDUCE", "REDUCE_SCATTER"] = "ALL_REDUCE"
    # nanotron's name: each decoder layer's activations are recomputed in backward instead of kept (parallel/mesh.py)
    recompute_layer: bool = False


@frozen
class TokensArgs:
    sequence_length: int = field(validator=positive)
    train_steps: int = field(validator=positive)
    micro_batch_size: int = field(validator=positive)
    # Unset: global_batch_size / (micro_batch_size × dp) when global_batch_size is stated, else 1 —
    # so a run that states its global batch keeps it on any dp.
    batch_accumulation_per_replica: Union[int, None] = field(default=None, validator=optional(positive))
    global_batch_size: Union[int, None] = field(default=None, validator=optional(positive))


@frozen
class LRSchedulerArgs:
    learning_rate: float = field(validator=positive_float)
    lr_warmup_steps: int = field(default=0, validator=non_negative)
    lr_warmup_style: Literal["linear", "constant"] = "linear"
    lr_decay_style: Literal["linear", "cosine", "1-sqrt", "constant"] = "cosine"
    lr_decay_starting_step: Union[int, None] = field(default=None, validator=optional(positive))
    lr_decay_steps: Union[int, None] = field(default=None, validator=optional(positive))
    min_decay_lr: float = field(default=0.0, validator=[instance_of((int, float)), ge(0)])


@frozen
class OptimizerFactoryArgs:
    name: Literal["adamW"] = "adamW"
    adam_beta1: float = field(default=0.9, validator=unit_interval)
    adam_beta2: float = field(default=0.95, validator=unit_interval)
    adam_eps: float = field(default=1e-8, validator=positive_float)
    torch_adam_is_fused: bool = False


def _clip_grad_valid(_instance, _attribute, value) -> None:
    if value is not False and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(CLIP_GRAD_EXPECTED + f", got {value!r}")


CLIP_GRAD_EXPECTED = "expected the max gradient norm (a number > 0) or false for no clipping"


@frozen
class OptimizerArgs:
    learning_rate_scheduler: LRSchedulerArgs
    optimizer_factory: OptimizerFactoryArgs = Factory(OptimizerFactoryArgs)
    weight_decay: float = field(default=0.0, validator=[instance_of((int, float)), ge(0)])
    # The max global gradient norm, or False for no clipping (nanotron's `clip_grad: null`; TOML has no null).
    clip_grad: Union[float, Literal[False]] = field(default=1.0, validator=_clip_grad_valid)

    @property
    def max_grad_norm(self) -> Union[float, None]:
        """The norm gradients are clipped to, or None when they are not clipped."""
        return None if self.clip_grad is False else self.clip_grad


@frozen
class CheckpointsArgs:
    checkpoints_path: str = "checkpoints"          # a local folder or s3://bucket/prefix; metrics.jsonl goes here too
    checkpoint_interval: int = field(default=1000, validator=positive)
    resume_checkpoint_path: Union[str, None] = None
    load_optimizer: bool = True
    load_lr_scheduler: bool = True
    keep: Union[int, None] = field(default=None, validator=optional(positive))
    # Resume although a begun stage's data, tokenizer or seeds changed (OLMo-core's name); warns, naming the change.
    ignore_fingerprint_mismatch: bool = False
    # Resume although the LR schedule of the stage being trained changed under the checkpoint (a stage's length
    # edited, a stage inserted after the resume step, its LR keys): warns, naming the change and the LR jump.
    ignore_lr_schedule_change: bool = False
    # Write checkpoints from a background thread off a host copy of the state; training goes on meanwhile.
    async_save: bool = False


@frozen
class LoggingArgs:
    iteration_step_info_interval: int = field(default=1, validator=positive)


@frozen
class DatasetArgs:
    """HF `datasets` sources (nanotron's PretrainDatasetsArgs): a builder ("text", "json", "parquet", "csv",
    "arrow") over local files, a folder saved with `Dataset.save_to_disk`, or a hub dataset; or a
    `{name = weight}` table of such names to blend (a name may then also be a local path or glob)."""

    hf_dataset_or_datasets: Union[str, dict[str, float]]
    hf_data_files: Union[str, list[str], None] = None
    hf_dataset_config_name: Union[str, None] = None
    # One split to train on, or nanotron's list: the listed splits are loaded and "train" is trained on
    # (run_train.py: get_datasets(...)["train"]); the others are there to evaluate on.
    hf_dataset_splits: Union[str, list[str]] = "train"
    text_column_name: str = "text"
    prompt_column_name: Union[str, None] = None       # with completion_column_name: an SFT stage
    completion_column_name: Union[str, None] = None
    dataset_processing_num_proc_per_process: int = field(default=1, validator=positive)
    dataset_overwrite_cache: bool = False
    # With a {name = weight} table: the same names' weights at the stage's end; shares move linearly in between.
    dataset_weights_end: Union[dict[str, float], None] = None
    # Evaluation (issue 14): the last N samples (windows, or SFT rows) of each source are kept out of training,
    # for an [[evaluation.datasets]] entry with held_out_of = this stage.
    held_out_samples: Union[int, None] = field(default=None, validator=optional(positive))

    @property
    def is_sft(self) -> bool:
        return self.prompt_column_name is not None

    @property
    def columns(self) -> tuple[str, ...]:
        return (self.prompt_column_name, self.completion_column_name) if self.is_sft else (self.text_column_name,)

    @property
    def listed_splits(self) -> tuple[str, ...]:
        splits = self.hf_dataset_splits
        return (splits,) if isinstance(splits, str) else tuple(splits)

    @property
    def train_split(self) -> str:
        """The split training reads: the one named, or "train" of a list (as in nanotron)."""
        return self.hf_dataset_splits if isinstance(self.hf_dataset_splits, str) else "train"

    @property
    def untrained_splits(self) -> tuple[str, ...]:
        """The listed splits training does not read."""
        return tuple(split for split in self.listed_splits if split != self.train_split)

    def weighted_names(self) -> tuple[tuple[str, float], ...]:
        """(name, weight) of each source: a plain name is one source of weight 1."""
        if isinstance(self.hf_dataset_or_datasets, str):
            return ((self.hf_dataset_or_datasets, 1.0),)
        return tuple((name, float(weight)) for name, weight in self.hf_dataset_or_datasets.items())

    def weights_end(self) -> tuple[float, ...] | None:
        """The end weight of each source of `weighted_names` (0 for a name the end table lacks), or None."""
        ends = self.dataset_weights_end
        return None if ends is None else tuple(float(ends.get(name, 0.0)) for name, _ in self.weighted_names())

    def source_key(self, name: str) -> str:
        """What identifies one source across stages (continue_from): the data and how it is read."""
        files = self.hf_data_files if isinstance(self.hf_dataset_or_datasets, str) else None
        return "hf:" + json.dumps([name, files, self.hf_dataset_config_name, self.hf_dataset_splits, self.columns])

    def source_keys(self) -> tuple[str, ...]:
        return tuple(self.source_key(name) for name, _ in self.weighted_names())


@frozen
class NanosetDatasetsArgs:
    """Folders of pre-tokenized files (nanotron's NanosetDatasetsArgs; the `*.ds` layout HF datatrove writes and
    `bin/prepare` writes). Several folders are blended by `dataset_weights`; without weights, in proportion to
    their sizes (each folder read once per epoch of the whole, as nanotron does)."""

    dataset_folder: Union[str, list[str]]
    dataset_weights: Union[list[float], None] = None
    # The folders' weights at the stage's end (needs dataset_weights); shares move linearly in between.
    dataset_weights_end: Union[list[float], None] = None
    held_out_samples: Union[int, None] = field(default=None, validator=optional(positive))   # as in DatasetArgs

    is_sft = False

    @property
    def folders(self) -> tuple[str, ...]:
        return (self.dataset_folder,) if isinstance(self.dataset_folder, str) else tuple(self.dataset_folder)

    def weights_end(self) -> tuple[float, ...] | None:
        return None if self.dataset_weights_end is None else tuple(self.dataset_weights_end)

    def source_key(self, folder: str) -> str:
        return "tokens:" + os.path.abspath(folder)

    def source_keys(self) -> tuple[str, ...]:
        return tuple(self.source_key(folder) for folder in self.folders)


@frozen
class DataArgs:
    dataset: Union[DatasetArgs, NanosetDatasetsArgs]
    seed: Union[int, None] = None             # defaults to general.seed
    num_loading_workers: int = field(default=0, validator=non_negative)   # background threads building batches
    # The name of an earlier stage: sources this stage shares with it continue where that stage stopped.
    continue_from: Union[str, None] = None


@frozen
class StageLRSchedulerArgs:
    """[data_stages.learning_rate_scheduler]: the stage's own LR schedule, replacing the run's for its steps
    (nanoflow.lr.resolve_stage_lr). Every key is optional: learning_rate defaults to the run's LR at the
    stage's first step, the decay (linear) to the stage's last step, min_decay_lr to the run's.
    lr_decay_starting_step is a global step, as in nanotron."""

    learning_rate: Union[float, None] = field(default=None, validator=optional(positive_float))
    lr_warmup_steps: int = field(default=0, validator=non_negative)
    lr_warmup_style: Literal["linear", "constant"] = "linear"
    # nanotron's default; not the run's style, which for a WSD run is the "constant" a cooldown ends
    lr_decay_style: Literal["linear", "cosine", "1-sqrt", "constant"] = "linear"
    lr_decay_starting_step: Union[int, None] = field(default=None, validator=optional(positive))
    lr_decay_steps: Union[int, None] = field(default=None, validator=optional(positive))
    min_decay_lr: Union[float, None] = field(default=None, validator=optional([instance_of((int, float)), ge(0)]))


@frozen
class DatasetStageArgs:
    name: str
    start_training_step: int
    data: DataArgs
    # Per-stage overrides of [tokens]:
    sequence_length: Union[int, None] = field(default=None, validator=optional(positive))
    micro_batch_size: Union[int, None] = field(default=None, validator=optional(positive))
    batch_accumulation_per_replica: Union[int, None] = field(default=None, validator=optional(positive))
    global_batch_size: Union[int, None] = field(default=None, validator=optional(positive))
    learning_rate_scheduler: Union[StageLRSchedulerArgs, None] = None   # None: the run's schedule


# ---------------------------------------------------------------------------------------------
# [evaluation] (issue 14): fixed held-out sets, evaluated during training and by bin/eval

@frozen
class EvalDatasetArgs:
    """One [[evaluation.datasets]] entry: its own `dataset` table (the keys of data_stages.data.dataset), or
    `held_out_of` a stage, whose source keeps its last held_out_samples samples out of training for it."""

    name: str
    dataset: Union[DatasetArgs, NanosetDatasetsArgs, None] = None
    held_out_of: Union[str, None] = None
    max_samples: int = field(default=128, validator=positive)   # evenly spaced over the set: a fixed subset
    metric: Literal["loss", "exact_match"] = "loss"
    # Unset: the stage's for held_out_of (its windows are cut at that length), else tokens.sequence_length.
    sequence_length: Union[int, None] = field(default=None, validator=optional(positive))
    micro_batch_size: Union[int, None] = field(default=None, validator=optional(positive))  # unset: tokens'


@frozen
class EvaluationArgs:
    # Every `interval` steps; always also at each stage's last step (the run's end is one).
    interval: Union[int, None] = field(default=None, validator=optional(positive))
    datasets: tuple[EvalDatasetArgs, ...] = ()


def _by_start_step(stages) -> tuple[DatasetStageArgs, ...]:
    return tuple(sorted(stages, key=lambda s: s.start_training_step))


@frozen
class Config:
    model: ModelArgs
    tokens: TokensArgs
    optimizer: OptimizerArgs
    # Sorted by start step, so a stage's index here is its index in the Schedule.
    data_stages: tuple[DatasetStageArgs, ...] = field(converter=_by_start_step)
    general: GeneralArgs = Factory(GeneralArgs)
    tokenizer: TokenizerArgs = Factory(TokenizerArgs)
    parallelism: ParallelismArgs = Factory(ParallelismArgs)
    checkpoints: CheckpointsArgs = Factory(CheckpointsArgs)
    logging: LoggingArgs = Factory(LoggingArgs)
    evaluation: Union[EvaluationArgs, None] = None   # None: no evaluation (and nothing recorded for it)

    def stage_tokens(self, index: int) -> TokensArgs:
        """[tokens] with stage `index`'s overrides applied and the accumulation resolved."""
        stage = self.data_stages[index]
        overrides = {key: getattr(stage, key) for key in
                     ("sequence_length", "micro_batch_size", "batch_accumulation_per_replica", "global_batch_size")
                     if getattr(stage, key) is not None}
        tokens = attrs.evolve(self.tokens, **overrides)
        if tokens.batch_accumulation_per_replica is None:
            per_step = tokens.micro_batch_size * self.parallelism.dp
            stated = tokens.global_batch_size
            accumulation = stated // per_step if stated is not None and stated % per_step == 0 else 1
            tokens = attrs.evolve(tokens, batch_accumulation_per_replica=accumulation)
        return tokens

    def eval_sequence_length(self, entry: EvalDatasetArgs) -> int:
        """An eval set's sequence length: its own; else, held out of a stage, that stage's (the reserved windows
        are cut at it); else tokens.sequence_length, the run's base length, which adding a stage never changes."""
        if entry.sequence_length is not None:
            return entry.sequence_length
        names = [stage.name for stage in self.data_stages]
        if entry.held_out_of in names:
            return self.stage_tokens(names.index(entry.held_out_of)).sequence_length
        return self.tokens.sequence_length

    def data_seed(self, index: int) -> int:
        seed = self.data_stages[index].data.seed
        return self.general.seed if seed is None else seed

    def to_dict(self) -> dict:
        """The resolved config as plain data (None values dropped, so it round-trips through TOML)."""
        return _drop_none(converter.unstructure(self))


def _drop_none(value):
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_none(v) for v in value]
    return value


converter = cattrs.Converter(forbid_extra_keys=True)


def _structure_exact(value, cls):
    """TOML already gives exact types: refuse lossy coercions such as "3" -> 3, 2.5 -> 2 or 1 -> True,
    non-finite floats (inf, nan: no setting means them) and integers beyond int64."""
    if cls is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value!r}")
    elif cls is bool:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, cls) and not isinstance(value, bool)
    if not ok:
        raise TypeError(f"expected {cls.__name__}, got {type(value).__name__} {value!r}")
    if cls is int and not -INT_LIMIT <= value < INT_LIMIT:
        raise ValueError(f"{value} does not fit in a 64-bit integer (at most {INT_LIMIT - 1})")
    return cls(value)


for _type in (int, float, str, bool):
    converter.register_structure_hook(_type, _structure_exact)


def _structure_paths(value, _cls):
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise TypeError(f"expected a path or a list of paths, got {value!r}")


converter.register_structure_hook(Union[str, list[str], None], _structure_paths)


def _structure_name_list(value, _cls):
    if value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise TypeError(f"expected a list of names, got {value!r}" + (f' (write ["{value}"])' if isinstance(value, str)
                                                                    else ""))


converter.register_structure_hook(Union[list[str], None], _structure_name_list)


def _structure_names(value, _cls):
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        return value
    raise TypeError(f"expected a name or a non-empty list of names, got {value!r}")


def _structure_weight(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number as the weight of {where}, got {value!r}")
    return float(value)


def _structure_datasets(value, _cls):
    """hf_dataset_or_datasets: a name, or a table {name = weight}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value:
        return {str(name): _structure_weight(weight, repr(name)) for name, weight in value.items()}
    raise TypeError(f"expected a dataset name or a table {{name = weight}}, got {value!r}")


def _structure_weight_table(value, _cls):
    """dataset_weights_end of HF datasets: a table {name = weight}, the names of hf_dataset_or_datasets."""
    if value is None:
        return None
    if isinstance(value, dict) and value:
        return {str(name): _structure_weight(weight, repr(name)) for name, weight in value.items()}
    raise TypeError(f"expected a table {{name = weight}} of the names in hf_dataset_or_datasets, got {value!r}")


def _structure_weights(value, _cls):
    if value is None:
        return None
    if isinstance(value, list):
        return [_structure_weight(w, f"entry {i}") for i, w in enumerate(value)]
    raise TypeError(f"expected a list of weights, got {value!r}")


def _structure_dataset(value, _cls):
    """[data_stages.data.dataset]: token folders when it names dataset_folder, else HF datasets."""
    if isinstance(value, dict) and "dataset_folder" in value:
        return converter.structure(value, NanosetDatasetsArgs)
    return converter.structure(value, DatasetArgs)


def _structure_rope_scaling(value, _cls):
    """[model.rope_scaling]; HF's legacy key `type` is read as rope_type, as transformers reads it."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"expected a table of rope_type, factor, ..., got {value!r}")
    value = dict(value)
    if "type" in value:
        legacy = value.pop("type")
        if value.setdefault("rope_type", legacy) != legacy:
            raise ValueError(f"type = {legacy!r} and rope_type = {value['rope_type']!r} disagree; "
                             "write rope_type only (type is its legacy name)")
    return converter.structure(value, RopeScalingArgs)


def _structure_clip_grad(value, _cls):
    if value is True:
        raise TypeError("true is not a max norm: give the max gradient norm (e.g. 1.0), or false for no clipping")
    if value is False:
        return False
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r} (false means no clipping)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(CLIP_GRAD_EXPECTED + f", got {value!r}")
    return float(value)


converter.register_structure_hook(Union[str, list[str]], _structure_names)
converter.register_structure_hook(Union[RopeScalingArgs, None], _structure_rope_scaling)
converter.register_structure_hook(Union[float, Literal[False]], _structure_clip_grad)
converter.register_structure_hook(Union[str, dict[str, float]], _structure_datasets)
converter.register_structure_hook(Union[list[float], None], _structure_weights)
converter.register_structure_hook(Union[dict[str, float], None], _structure_weight_table)
converter.register_structure_hook(Union[DatasetArgs, NanosetDatasetsArgs], _structure_dataset)
converter.register_structure_hook(Union[DatasetArgs, NanosetDatasetsArgs, None],
                                  lambda value, cls: None if value is None else _structure_dataset(value, cls))


