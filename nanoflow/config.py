"""The run configuration: nanotron's config schema, written in TOML.

Field names follow nanotron so a nanotron YAML translates key for key, with HF LlamaConfig names
in [model]. Every section is a small frozen attrs class; one cattrs converter structures the
TOML into them, rejecting unknown keys. `load_config` then resolves paths relative to the TOML
file and checks everything that can be checked before any expensive work, naming the file, the
stage and the key of each problem.
"""

from __future__ import annotations

import difflib
import glob
import json
import math
import os
import sys
from pathlib import Path
from typing import Literal, Union

import attrs
import cattrs
from attrs import Factory, field, frozen
from attrs.validators import ge, gt, instance_of, optional
from cattrs.errors import ForbiddenExtraKeysError

from nanoflow.schedule import Schedule, ScheduleError, stage_steps

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot run. The message names the file, the stage and the key."""


positive = [instance_of(int), gt(0)]
non_negative = [instance_of(int), ge(0)]
positive_float = [instance_of((int, float)), gt(0)]


@frozen
class GeneralArgs:
    project: str = "nanoflow"
    run: str = "run"
    seed: int = 42


@frozen
class ModelArgs:
    """A Llama decoder, in HF LlamaConfig names, plus how to train it."""

    vocab_size: int = field(validator=positive)
    hidden_size: int = field(validator=positive)
    intermediate_size: int = field(validator=positive)
    num_hidden_layers: int = field(validator=positive)
    num_attention_heads: int = field(validator=positive)
    num_key_value_heads: int = field(
        default=Factory(lambda self: self.num_attention_heads, takes_self=True), validator=positive)
    max_position_embeddings: int = field(default=2048, validator=positive)
    rms_norm_eps: float = field(default=1e-5, validator=positive_float)
    rope_theta: float = field(default=10000.0, validator=positive_float)
    tie_word_embeddings: bool = False
    initializer_range: float = field(default=0.02, validator=positive_float)
    dtype: Literal["float32", "bfloat16"] = "float32"   # autocast dtype; master weights stay float32
    compile: bool = False                              # torch.compile each decoder layer
    init_from: Union[str, None] = None                 # start from these weights (a checkpoint or HF folder)


@frozen
class TokenizerArgs:
    tokenizer_name_or_path: str = "bytes"   # the built-in byte tokenizer, or a tokenizer.json


@frozen
class ParallelismArgs:
    dp: int = field(default=1, validator=positive)
    tp: int = field(default=1, validator=positive)


@frozen
class TokensArgs:
    sequence_length: int = field(validator=positive)
    train_steps: int = field(validator=positive)
    micro_batch_size: int = field(validator=positive)
    batch_accumulation_per_replica: int = field(default=1, validator=positive)
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
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    torch_adam_is_fused: bool = False


@frozen
class OptimizerArgs:
    learning_rate_scheduler: LRSchedulerArgs
    optimizer_factory: OptimizerFactoryArgs = Factory(OptimizerFactoryArgs)
    weight_decay: float = field(default=0.0, validator=[instance_of((int, float)), ge(0)])
    clip_grad: Union[float, None] = field(default=1.0, validator=optional(positive_float))


@frozen
class CheckpointsArgs:
    checkpoints_path: str = "checkpoints"          # a local folder or s3://bucket/prefix; metrics.jsonl goes here too
    checkpoint_interval: int = field(default=1000, validator=positive)
    resume_checkpoint_path: Union[str, None] = None
    load_optimizer: bool = True
    load_lr_scheduler: bool = True
    keep: Union[int, None] = field(default=None, validator=optional(positive))


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
    hf_dataset_splits: Union[str, list[str]] = "train"   # a list is read as the splits concatenated
    text_column_name: str = "text"
    prompt_column_name: Union[str, None] = None       # with completion_column_name: an SFT stage
    completion_column_name: Union[str, None] = None
    dataset_processing_num_proc_per_process: int = field(default=1, validator=positive)
    dataset_overwrite_cache: bool = False

    @property
    def is_sft(self) -> bool:
        return self.prompt_column_name is not None

    @property
    def columns(self) -> tuple[str, ...]:
        return (self.prompt_column_name, self.completion_column_name) if self.is_sft else (self.text_column_name,)

    def weighted_names(self) -> tuple[tuple[str, float], ...]:
        """(name, weight) of each source: a plain name is one source of weight 1."""
        if isinstance(self.hf_dataset_or_datasets, str):
            return ((self.hf_dataset_or_datasets, 1.0),)
        return tuple((name, float(weight)) for name, weight in self.hf_dataset_or_datasets.items())

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

    is_sft = False

    @property
    def folders(self) -> tuple[str, ...]:
        return (self.dataset_folder,) if isinstance(self.dataset_folder, str) else tuple(self.dataset_folder)

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
class DatasetStageArgs:
    name: str
    start_training_step: int
    data: DataArgs
    # Per-stage overrides of [tokens]:
    sequence_length: Union[int, None] = field(default=None, validator=optional(positive))
    micro_batch_size: Union[int, None] = field(default=None, validator=optional(positive))
    batch_accumulation_per_replica: Union[int, None] = field(default=None, validator=optional(positive))
    global_batch_size: Union[int, None] = field(default=None, validator=optional(positive))


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

    def stage_tokens(self, index: int) -> TokensArgs:
        """[tokens] with stage `index`'s overrides applied."""
        stage = self.data_stages[index]
        overrides = {key: getattr(stage, key) for key in
                     ("sequence_length", "micro_batch_size", "batch_accumulation_per_replica", "global_batch_size")
                     if getattr(stage, key) is not None}
        return attrs.evolve(self.tokens, **overrides)

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
    """TOML already gives exact types: refuse lossy coercions such as "3" -> 3, 2.5 -> 2 or 1 -> True."""
    if cls is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif cls is bool:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, cls) and not isinstance(value, bool)
    if not ok:
        raise TypeError(f"expected {cls.__name__}, got {type(value).__name__} {value!r}")
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


converter.register_structure_hook(Union[str, list[str]], _structure_names)
converter.register_structure_hook(Union[str, dict[str, float]], _structure_datasets)
converter.register_structure_hook(Union[list[float], None], _structure_weights)
converter.register_structure_hook(Union[DatasetArgs, NanosetDatasetsArgs], _structure_dataset)


# ---------------------------------------------------------------------------------------------
# Loading

BUILDERS = ("text", "json", "csv", "parquet", "arrow")


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Read, override, structure and validate a TOML config. Raises ConfigError."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for override in overrides:
        apply_override(raw, override, path)
    _resolve_paths(raw, path.parent)
    try:
        config = converter.structure(raw, Config)
    except Exception as e:  # cattrs gathers every problem into one exception group
        raise ConfigError(f"{path}:\n  " + "\n  ".join(_describe_structure_errors(e, raw))) from None
    problems = validate(config)
    if problems:
        raise ConfigError(f"{path}:\n  " + "\n  ".join(problems))
    return config


def apply_override(raw: dict, override: str, path: Path) -> None:
    """Apply `section.key=value` (value in TOML syntax; a bare word is a string) to the raw config.

    Stages are addressed by name or index: `data_stages.sft.sequence_length=64`.
    """
    dotted, sep, text = override.partition("=")
    if not sep or not dotted:
        raise ConfigError(f"--set {override!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    keys = dotted.strip().split(".")
    node = raw
    for i, key in enumerate(keys[:-1]):
        if isinstance(node, list):
            node = _stage_by_name_or_index(node, key, override, path)
        else:
            node = node.setdefault(key, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"--set {override!r}: {'.'.join(keys[:i + 1])} in {path} is not a table")
    if isinstance(node, list):
        raise ConfigError(f"--set {override!r}: name a key inside the stage, e.g. data_stages.{keys[-1]}.sequence_length")
    node[keys[-1]] = value


def _stage_by_name_or_index(stages: list, key: str, override: str, path: Path) -> dict:
    for i, stage in enumerate(stages):
        if stage.get("name") == key or str(i) == key:
            return stage
    names = ", ".join(str(s.get("name")) for s in stages)
    raise ConfigError(f"--set {override!r}: {path} has no stage {key!r} (stages: {names})")


def _resolve(base: Path, value: str) -> str:
    if "://" in value or os.path.isabs(value):
        return value
    return os.path.abspath(base / value)


def _resolve_paths(raw: dict, base: Path) -> None:
    """Make every path in the config relative to the TOML file, not to the working directory."""
    for section, key in (("checkpoints", "checkpoints_path"), ("checkpoints", "resume_checkpoint_path"),
                         ("model", "init_from")):
        table = raw.get(section)
        if isinstance(table, dict) and isinstance(table.get(key), str):
            table[key] = _resolve(base, table[key])
    tokenizer = raw.get("tokenizer")
    if isinstance(tokenizer, dict) and isinstance(tokenizer.get("tokenizer_name_or_path"), str) \
            and tokenizer["tokenizer_name_or_path"] != "bytes":
        tokenizer["tokenizer_name_or_path"] = _resolve(base, tokenizer["tokenizer_name_or_path"])
    for stage in raw.get("data_stages", []) if isinstance(raw.get("data_stages"), list) else []:
        dataset = stage.get("data", {}).get("dataset") if isinstance(stage.get("data"), dict) else None
        if not isinstance(dataset, dict):
            continue
        files = dataset.get("hf_data_files")
        if isinstance(files, str):
            dataset["hf_data_files"] = _resolve(base, files)
        elif isinstance(files, list):
            dataset["hf_data_files"] = [_resolve(base, f) if isinstance(f, str) else f for f in files]
        name = dataset.get("hf_dataset_or_datasets")
        if isinstance(name, str) and name not in BUILDERS and (base / name).exists():
            dataset["hf_dataset_or_datasets"] = _resolve(base, name)
        elif isinstance(name, dict):   # a blend: a name that is a local path or glob is relative to the TOML file
            dataset["hf_dataset_or_datasets"] = {
                (_resolve(base, key) if key not in BUILDERS and ((base / key).exists() or glob.glob(str(base / key),
                                                                                               recursive=True))
                 else key): weight for key, weight in name.items()}
        folders = dataset.get("dataset_folder")
        if isinstance(folders, str):
            dataset["dataset_folder"] = _resolve(base, folders)
        elif isinstance(folders, list):
            dataset["dataset_folder"] = [_resolve(base, f) if isinstance(f, str) else f for f in folders]


# ---------------------------------------------------------------------------------------------
# Error messages

def _describe_structure_errors(exc: BaseException, raw: dict) -> list[str]:
    def describe(error: BaseException, _type) -> str:
        if isinstance(error, ForbiddenExtraKeysError):
            valid = [f.name for f in attrs.fields(error.cl)]
            parts = []
            for key in sorted(error.extra_fields):
                near = difflib.get_close_matches(key, valid, n=1)
                parts.append(f"unknown key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else
                                                      f" (valid keys: {', '.join(valid)})"))
            return "; ".join(parts)
        if isinstance(error, KeyError):
            return "required key missing"
        if isinstance(error, (ValueError, TypeError)):
            return str(error)
        return cattrs.v.format_exception(error, _type)

    lines = []
    for line in cattrs.transform_error(exc, path="$", format_exception=describe):
        message, _, where = line.rpartition(" @ ")
        lines.append(f"{_readable_path(where, raw)}: {message}")
    return lines


def _readable_path(where: str, raw: dict) -> str:
    """'$.data_stages[1].data.dataset' -> 'data_stages[1] (stage "sft").data.dataset'."""
    where = where.removeprefix("$").lstrip(".")
    if where.startswith("data_stages["):
        index_text, _, rest = where[len("data_stages["):].partition("]")
        stages = raw.get("data_stages", [])
        try:
            name = stages[int(index_text)].get("name")
        except (ValueError, IndexError, AttributeError):
            name = None
        label = f'data_stages[{index_text}]' + (f' (stage "{name}")' if name else "")
        return label + rest
    return where or "(top level)"


# ---------------------------------------------------------------------------------------------
# Validation across keys

def validate(config: Config) -> list[str]:
    """Every problem that can be found without loading data or building the model."""
    problems = []
    model, par = config.model, config.parallelism

    def stage_label(i: int) -> str:
        return f'data_stages[{i}] (stage "{config.data_stages[i].name}")'

    if model.num_attention_heads % model.num_key_value_heads:
        problems.append(f"model.num_attention_heads = {model.num_attention_heads} is not divisible by "
                        f"model.num_key_value_heads = {model.num_key_value_heads}")
    if model.hidden_size % model.num_attention_heads:
        problems.append(f"model.hidden_size = {model.hidden_size} is not divisible by "
                        f"model.num_attention_heads = {model.num_attention_heads}")
    for key in ("num_attention_heads", "num_key_value_heads"):
        if getattr(model, key) % par.tp:
            problems.append(f"model.{key} = {getattr(model, key)} is not divisible by parallelism.tp = {par.tp}")
    world = os.environ.get("WORLD_SIZE")
    if world is not None and (not world.isdigit() or int(world) != par.dp * par.tp):
        problems.append(f"parallelism.dp × parallelism.tp = {par.dp} × {par.tp} = {par.dp * par.tp}, "
                        f"but torchrun started {world} processes")

    if not config.data_stages:
        problems.append("data_stages: the schedule has no stages; add at least one [[data_stages]] table")
        return problems
    too_long = "sequence_length = {} exceeds model.max_position_embeddings = " + str(model.max_position_embeddings)
    if config.tokens.sequence_length > model.max_position_embeddings:
        problems.append("tokens: " + too_long.format(config.tokens.sequence_length))
    for i in range(len(config.data_stages)):
        tokens = config.stage_tokens(i)
        if config.data_stages[i].sequence_length is not None and tokens.sequence_length > model.max_position_embeddings:
            problems.append(f"{stage_label(i)}: " + too_long.format(tokens.sequence_length))
        derived = tokens.micro_batch_size * tokens.batch_accumulation_per_replica * par.dp
        if tokens.global_batch_size is not None and tokens.global_batch_size != derived:
            problems.append(
                f"{stage_label(i)}: global_batch_size = {tokens.global_batch_size}, but micro_batch_size × "
                f"batch_accumulation_per_replica × dp = {tokens.micro_batch_size} × "
                f"{tokens.batch_accumulation_per_replica} × {par.dp} = {derived}")
        problems.extend(f"{stage_label(i)}.data.dataset: {p}" for p in _dataset_problems(config.data_stages[i].data.dataset))
        problems.extend(f"{stage_label(i)}.data.continue_from: {p}" for p in _continue_from_problems(config, i))
    if config.tokenizer.tokenizer_name_or_path != "bytes" and not os.path.exists(config.tokenizer.tokenizer_name_or_path):
        problems.append(f"tokenizer.tokenizer_name_or_path: {config.tokenizer.tokenizer_name_or_path} does not exist")
    if model.init_from is not None and "://" not in model.init_from and not os.path.exists(model.init_from):
        problems.append(f"model.init_from: {model.init_from} does not exist")
    problems.extend(_hf_init_from_problems(model))

    try:
        Schedule.from_config(config)
    except ScheduleError as e:
        # The last stage of that name: for a duplicate name, the second one is the culprit.
        culprit = next((i for i, s in reversed(list(enumerate(config.data_stages))) if s.name == e.stage), None)
        key = {"start_step": "start_training_step"}.get(e.key, e.key)
        prefix = f"{stage_label(culprit)}.{key}" if culprit is not None else (
            "tokens.train_steps" if e.key == "train_steps" else e.key)
        problems.append(f"{prefix}: {e}")
    return problems


# ---------------------------------------------------------------------------------------------
# [model] init_from = an HF model folder: its config.json must describe the same model

# [model] key -> (config.json key, transformers' LlamaConfig default when config.json omits it).
# initializer_range is not compared: it only matters for weights that init_from replaces.
HF_MODEL_KEYS = {
    "vocab_size": ("vocab_size", 32000),
    "hidden_size": ("hidden_size", 4096),
    "intermediate_size": ("intermediate_size", 11008),
    "num_hidden_layers": ("num_hidden_layers", 32),
    "num_attention_heads": ("num_attention_heads", 32),
    "num_key_value_heads": ("num_key_value_heads", None),   # None: = num_attention_heads
    "max_position_embeddings": ("max_position_embeddings", 2048),
    "rms_norm_eps": ("rms_norm_eps", 1e-6),
    "rope_theta": ("rope_theta", 10000.0),
    "tie_word_embeddings": ("tie_word_embeddings", False),
}


def hf_config_mismatches(model: ModelArgs, hf: dict, source: str = "config.json") -> list[str]:
    """Every way an HF config.json (as a dict) differs from the [model] section, one line per key.

    Also names the architecture features nanoflow's Llama does not have (biases, another activation,
    RoPE scaling, a head_dim other than hidden_size / num_attention_heads, a model_type other than llama).
    """
    problems = []
    for key, (hf_key, default) in HF_MODEL_KEYS.items():
        where = hf_key
        if hf_key == "rope_theta" and "rope_theta" not in hf and isinstance(hf.get("rope_parameters"), dict):
            value, where = hf["rope_parameters"].get("rope_theta", default), "rope_parameters.rope_theta"
        elif hf_key in hf:
            value = hf[hf_key]
        else:
            value = hf.get("num_attention_heads", 32) if default is None else default
            where = f"{hf_key} (absent: transformers' default)"
        ours = getattr(model, key)
        if value != ours or isinstance(value, bool) != isinstance(ours, bool):
            problems.append(f"model.{key} = {ours!r}, but {source} has {where} = {value!r}")
    unsupported = []
    if hf.get("model_type", "llama") != "llama":
        unsupported.append(f"model_type = {hf['model_type']!r} (nanoflow trains llama)")
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act = {hf['hidden_act']!r} (nanoflow's MLP uses silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias):
            unsupported.append(f"{bias} = true (nanoflow's projections have no bias)")
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        unsupported.append(f"rope scaling {hf.get('rope_scaling') or rope!r} (nanoflow uses plain RoPE)")
    heads = hf.get("num_attention_heads")
    if hf.get("head_dim") is not None and heads and hf.get("hidden_size") and hf["head_dim"] != hf["hidden_size"] // heads:
        unsupported.append(f"head_dim = {hf['head_dim']} != hidden_size / num_attention_heads")
    problems += [f"{source}: {u}: not supported" for u in unsupported]
    return problems


def _hf_init_from_problems(model: ModelArgs) -> list[str]:
    """init_from names a local HF folder (a config.json, no checkpoint): compare it with [model].

    An s3:// HF folder is checked when its weights are read (nanoflow.io.read_init_weights), still before training.
    """
    path = model.init_from
    if path is None or "://" in path or not os.path.isfile(os.path.join(path, "config.json")) \
            or os.path.exists(os.path.join(path, "checkpoint_metadata.json")) \
            or os.path.exists(os.path.join(path, "latest.txt")):
        return []
    source = os.path.join(path, "config.json")
    try:
        import json
        with open(source) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        return [f"model.init_from: {source} cannot be read: {e}"]
    if not isinstance(hf, dict):
        return [f"model.init_from: {source} is not a JSON object"]
    return [f"model.init_from: {p}" for p in hf_config_mismatches(model, hf, source)]


def _weight_problems(key: str, weights: list[tuple[str, float]]) -> list[str]:
    problems = [f"{key}: the weight of {name} is {weight}; weights must be finite and >= 0"
                for name, weight in weights if not (math.isfinite(weight) and weight >= 0)]
    if not problems and not any(weight > 0 for _, weight in weights):
        problems.append(f"{key}: every weight is zero; at least one source must have a positive weight")
    return problems


def _dataset_problems(dataset: DatasetArgs | NanosetDatasetsArgs) -> list[str]:
    if isinstance(dataset, NanosetDatasetsArgs):
        return _nanoset_problems(dataset)
    problems = []
    name, files = dataset.hf_dataset_or_datasets, dataset.hf_data_files
    if isinstance(name, dict):
        if files is not None:
            problems.append("hf_data_files: a table of datasets names its files in its keys (a path or glob each); "
                            "remove hf_data_files")
        for key in name:
            if key in BUILDERS:
                problems.append(f'hf_dataset_or_datasets: "{key}" needs files; in a table, name the files '
                                f'themselves (e.g. "corpus/*.txt" = 1.0)')
            elif os.path.isabs(key) and not glob.glob(key, recursive=True):
                problems.append(f"hf_dataset_or_datasets: {key} matches no file")
        problems += _weight_problems("hf_dataset_or_datasets", list(name.items()))
    elif name in BUILDERS:
        patterns = [files] if isinstance(files, str) else (files or [])
        if not patterns:
            problems.append(f'hf_data_files: the "{name}" builder needs hf_data_files')
        for pattern in patterns:
            if not glob.glob(pattern, recursive=True):
                problems.append(f"hf_data_files: {pattern} matches no file")
    elif os.path.isabs(name) and not os.path.exists(name):
        problems.append(f"hf_dataset_or_datasets: {name} does not exist")
    if (dataset.prompt_column_name is None) != (dataset.completion_column_name is None):
        problems.append("an SFT stage needs both prompt_column_name and completion_column_name")
    return problems


def _nanoset_problems(dataset: NanosetDatasetsArgs) -> list[str]:
    problems = []
    for folder in dataset.folders:
        if not os.path.exists(folder):
            problems.append(f"dataset_folder: {folder} does not exist")
        elif not os.path.isdir(folder):
            problems.append(f"dataset_folder: {folder} is not a folder")
        elif not glob.glob(os.path.join(glob.escape(folder), "*.ds")):
            problems.append(f"dataset_folder: {folder} holds no token files (*.ds); write them with bin/prepare")
    if len(set(map(os.path.abspath, dataset.folders))) != len(dataset.folders):
        problems.append("dataset_folder: a folder is named twice")
    weights = dataset.dataset_weights
    if weights is not None:
        if len(weights) != len(dataset.folders):
            problems.append(f"dataset_weights: {len(weights)} weights for {len(dataset.folders)} folders")
        else:
            problems += _weight_problems("dataset_weights", list(zip(dataset.folders, weights)))
    return problems


def _continue_from_problems(config: Config, index: int) -> list[str]:
    """continue_from names an earlier stage with the same sequence length that reads one of this stage's sources."""
    stage = config.data_stages[index]
    name = stage.data.continue_from
    if name is None:
        return []
    earlier = {s.name: i for i, s in enumerate(config.data_stages[:index])
               if s.start_training_step < stage.start_training_step}
    if name not in earlier:
        names = ", ".join(f'"{n}"' for n in earlier) or "none"
        return [f'"{name}" is not a stage that starts before stage "{stage.name}" (earlier stages: {names})']
    other = earlier[name]
    ours, theirs = config.stage_tokens(index).sequence_length, config.stage_tokens(other).sequence_length
    if ours != theirs:
        return [f'continuing stage "{name}" needs its sequence_length ({theirs}), but this stage has {ours}: '
                "a sample is a window of sequence_length + 1 tokens, so positions do not carry over"]
    carried, chain = set(), other
    while chain is not None:   # the sources whose position the earlier stage carries: its own and its chain's
        carried |= set(config.data_stages[chain].data.dataset.source_keys())
        before = config.data_stages[chain].data.continue_from
        chain = next((i for i, s in enumerate(config.data_stages[:chain]) if s.name == before), None)
    if not set(stage.data.dataset.source_keys()) & carried:
        return [f'stage "{stage.name}" reads none of the sources of stage "{name}", so there is nothing to continue']
    return []


def unreached_stages(config: Config) -> list[str]:
    """Names of stages that start after train_steps: legal (a short trial of a long schedule), but worth a warning."""
    schedule = Schedule.from_config(config)
    return [s.name for i, s in enumerate(schedule.stages) if not stage_steps(schedule, i)]
