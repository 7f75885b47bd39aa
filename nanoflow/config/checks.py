"""Checks across keys: everything that can be found wrong before loading data or building the model."""

from __future__ import annotations

import difflib
import math
import os

import attrs

from nanoflow.config.locations import Location, locate, token_folder_problem
from nanoflow.config.schema import (
    Config,
    ConfigError,
    DatasetArgs,
    ModelArgs,
    NanosetDatasetsArgs,
    RopeScalingArgs,
)
from nanoflow.lr import resolve_stage_lr, stage_span
from nanoflow.schedule import Schedule, ScheduleError, stage_steps

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
    if par.tp_mode == "REDUCE_SCATTER":  # each tp rank holds sequence_length / tp positions between the blocks
        for index in range(len(config.data_stages)):
            length = config.stage_tokens(index).sequence_length
            if length % par.tp:
                problems.append(f"{stage_label(index)}: sequence_length = {length} is not divisible by "
                                f'parallelism.tp = {par.tp}, which parallelism.tp_mode = "REDUCE_SCATTER" needs')
    too_long = "sequence_length = {} exceeds model.max_position_embeddings = " + str(model.max_position_embeddings)
    if config.tokens.sequence_length > model.max_position_embeddings:
        problems.append("tokens: " + too_long.format(config.tokens.sequence_length))
    for i in range(len(config.data_stages)):
        tokens = config.stage_tokens(i)
        if config.data_stages[i].sequence_length is not None and tokens.sequence_length > model.max_position_embeddings:
            problems.append(f"{stage_label(i)}: " + too_long.format(tokens.sequence_length))
        derived = tokens.micro_batch_size * tokens.batch_accumulation_per_replica * par.dp
        accumulation_stated = (config.data_stages[i].batch_accumulation_per_replica is not None
                               or config.tokens.batch_accumulation_per_replica is not None)
        if tokens.global_batch_size is not None and not accumulation_stated \
                and tokens.global_batch_size % (tokens.micro_batch_size * par.dp):
            problems.append(
                f"{stage_label(i)}: global_batch_size = {tokens.global_batch_size} is not a multiple of "
                f"micro_batch_size × dp = {tokens.micro_batch_size} × {par.dp}")
        elif tokens.global_batch_size is not None and tokens.global_batch_size != derived:
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
    problems.extend(rope_scaling_problems(model.rope_scaling))
    problems.extend(_run_place_problems(config))
    problems.extend(_held_out_problems(config))
    problems.extend(evaluation_problems(config))

    try:
        schedule = Schedule.from_config(config)
        for i in range(len(config.data_stages)):
            problems.extend(f"{stage_label(i)}.learning_rate_scheduler.{p}" for p in _stage_lr_problems(config, schedule, i))
    except ScheduleError as e:
        # The last stage of that name: for a duplicate name, the second one is the culprit.
        culprit = next((i for i, s in reversed(list(enumerate(config.data_stages))) if s.name == e.stage), None)
        key = {"start_step": "start_training_step"}.get(e.key, e.key)
        prefix = f"{stage_label(culprit)}.{key}" if culprit is not None else (
            "tokens.train_steps" if e.key == "train_steps" else e.key)
        problems.append(f"{prefix}: {e}")
    return problems


def _run_place_problems(config: Config) -> list[str]:
    """A run writes only inside its own folder: no empty path taken for the config's folder, no run name that
    is a path, no S3 prefix with a part that would climb out of the local record's folder (runfolder.py)."""
    problems = []
    for key, value in (("checkpoints.checkpoints_path", config.checkpoints.checkpoints_path),
                       ("checkpoints.resume_checkpoint_path", config.checkpoints.resume_checkpoint_path),
                       ("model.init_from", config.model.init_from)):
        if value is not None and not value.strip():
            problems.append(f"{key}: empty (an unset variable in --set?); name a folder, or s3://bucket/prefix")
        elif value is not None and value.startswith("s3://") and any(
                part in ("", ".", "..") for part in value[len("s3://"):].rstrip("/").split("/")):
            problems.append(f"{key} = {value}: an empty, '.' or '..' part; write s3://bucket/prefix/of/plain/parts")
    run = config.general.run
    if run in ("", ".", "..") or any(c in run for c in "/\\\0"):
        problems.append(f"general.run = {run!r}: a run's name, not a path (no '/', not '.' or '..', not empty); "
                        "where it writes is checkpoints.checkpoints_path")
    return problems


def _stage_lr_problems(config: Config, schedule: Schedule, index: int) -> list[str]:
    """A stage's own LR schedule must fit in the stage: warmup, decay start and decay end within its steps."""
    own = config.data_stages[index].learning_rate_scheduler
    span = stage_span(schedule, index)
    if own is None or not span:
        return []
    first, last = span.start, span.stop - 1
    steps = f"the stage's {len(span)} steps {first}–{last}"
    resolved = resolve_stage_lr(own, config.optimizer.learning_rate_scheduler, span, schedule.train_steps)
    if own.lr_warmup_steps > len(span) or (own.lr_warmup_steps == len(span) and resolved.decay_style != "constant"):
        return [f"lr_warmup_steps = {own.lr_warmup_steps} leaves no step of {steps} to decay in "
                '(lr_decay_style = "constant" keeps the peak after the warmup)']
    earliest = first - 1 + max(own.lr_warmup_steps, 1)
    if own.lr_decay_starting_step is not None and not earliest <= own.lr_decay_starting_step <= last:
        return [f"lr_decay_starting_step = {own.lr_decay_starting_step} is outside {steps}: it is a global step, "
                f"from {earliest} (the {'last warmup' if own.lr_warmup_steps else 'first'} step) to {last}"]
    if own.lr_decay_steps is not None and resolved.decay_start + resolved.decay_steps > last:
        return [f"lr_decay_steps = {own.lr_decay_steps}: the decay from step {resolved.decay_start} would end at step "
                f"{resolved.decay_start + resolved.decay_steps}, after the stage's last step {last}; at most "
                f"{last - resolved.decay_start} (unset: to the stage's last step)"]
    return []


# ---------------------------------------------------------------------------------------------
# RoPE scaling: [model.rope_scaling], and rope_scaling in an HF config.json

# The keys each rope_type needs, as transformers requires them (no others are used by that type).
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_scaling_problems(scaling: RopeScalingArgs | None) -> list[str]:
    """What is wrong with [model.rope_scaling]: an unknown rope_type, a key its type needs or does not use."""
    if scaling is None:
        return []
    where = "model.rope_scaling"
    if scaling.rope_type not in ROPE_KEYS:
        near = difflib.get_close_matches(scaling.rope_type, list(ROPE_KEYS), n=1)
        return [f"{where}.rope_type = {scaling.rope_type!r}: nanoflow implements "
                + ", ".join(f'"{t}"' for t in ROPE_KEYS) + (f' (did you mean "{near[0]}"?)' if near else "")]
    needed = ROPE_KEYS[scaling.rope_type]
    problems = []
    for key in ROPE_KEYS["llama3"]:   # every number any type takes
        given = getattr(scaling, key) is not None
        if key in needed and not given:
            problems.append(f'{where}.{key}: required with rope_type = "{scaling.rope_type}"')
        elif key not in needed and given:
            problems.append(f'{where}.{key}: not used by rope_type = "{scaling.rope_type}"; remove it')
    if scaling.rope_type == "llama3" and not problems and scaling.low_freq_factor >= scaling.high_freq_factor:
        problems.append(f"{where}: low_freq_factor = {scaling.low_freq_factor} must be below "
                        f"high_freq_factor = {scaling.high_freq_factor}")
    return problems


def hf_rope(hf: dict) -> tuple[str, dict, str]:
    """(the key of config.json's RoPE table, that table as transformers reads it, where its rope_theta came from).

    transformers < 5 writes `rope_scaling` and a top-level `rope_theta`; transformers 5 writes
    `rope_parameters` with rope_theta inside. A non-empty rope_scaling wins, and a rope_theta inside the
    table wins over the top-level one; `type` is the legacy name of rope_type; llama3's
    original_max_position_embeddings defaults to max_position_embeddings.
    """
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf[where]) if isinstance(hf.get(where), dict) else {}
    if "rope_theta" in rope:
        theta_where = f"{where}.rope_theta"
    elif "rope_theta" in hf:
        theta_where, rope["rope_theta"] = "rope_theta", hf["rope_theta"]
    else:
        theta_where, rope["rope_theta"] = "rope_theta (absent: transformers' default)", 10000.0
    rope.setdefault("rope_type", rope.pop("type", "default"))
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    return where, rope, theta_where


def _rope_mismatches(model: ModelArgs, hf: dict, source: str) -> tuple[list[str], list[str]]:
    """(mismatches with [model.rope_scaling], RoPE variants nanoflow does not implement) for config.json `hf`."""
    where, rope, _ = hf_rope(hf)
    kind = rope["rope_type"]
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    unsupported = [] if partial in (None, 1, 1.0) else \
        [f"partial_rotary_factor = {partial!r} (nanoflow rotates the whole head)"]
    if kind not in ROPE_KEYS:
        return [], unsupported + [f"{where}.rope_type = {kind!r} (nanoflow implements "
                                  + ", ".join(ROPE_KEYS) + ")"]
    theirs = {key: rope.get(key) for key in ROPE_KEYS[kind]}
    ours = model.rope_scaling or RopeScalingArgs()
    if ours.rope_type != kind:
        wanted = ", ".join([f'rope_type = "{kind}"'] + [f"{k} = {v!r}" for k, v in theirs.items()])
        return [f"model.rope_scaling.rope_type = {ours.rope_type!r}"
                + (" (unset: plain RoPE)" if model.rope_scaling is None else "")
                + f", but {source} has {where}.rope_type = {kind!r}; "
                f"write model.rope_scaling = {{{wanted}}}"], unsupported
    return [f"model.rope_scaling.{key} = {getattr(ours, key)!r}, but {source} has {where}.{key} = {value!r}"
            for key, value in theirs.items() if getattr(ours, key) != value], unsupported


# ---------------------------------------------------------------------------------------------
# [model] init_from = an HF model folder: its config.json must describe the same model (compared by
# nanoflow.preflight.check_init_from, which reads the folder; this module reads no files of a model)

# Every [model] key, by what a change of it means to weights that already exist (a resume; an HF
# init_from compares config.json on the `hf` ones): "shape" keys decide the weights' shapes and
# "numbers" keys what they were trained to compute — a change of either is refused; a change of a
# "changes" key is deliberate (a context extension moves RoPE; a new machine another autocast dtype,
# like another parallel layout) and warned of; "free" keys touch neither (a change is said).
# `hf`: (config.json key, transformers' LlamaConfig default when config.json omits it); rope_theta and
# rope_scaling are compared there by _rope_mismatches / hf_rope, initializer_range not at all (it
# only matters for weights that init_from replaces).
MODEL_KEYS = {
    "vocab_size": ("shape", ("vocab_size", 32000), ""),
    "hidden_size": ("shape", ("hidden_size", 4096), ""),
    "intermediate_size": ("shape", ("intermediate_size", 11008), ""),
    "num_hidden_layers": ("shape", ("num_hidden_layers", 32), ""),
    "num_attention_heads": ("shape", ("num_attention_heads", 32), ""),
    "num_key_value_heads": ("shape", ("num_key_value_heads", None), ""),   # None: = num_attention_heads
    "max_position_embeddings": ("free", ("max_position_embeddings", 2048),
                                "it bounds the sequence length; RoPE's tables are computed for the positions used"),
    "rms_norm_eps": ("numbers", ("rms_norm_eps", 1e-6), ""),
    "rope_theta": ("changes", None, "the positions are encoded otherwise from this step on (a context extension)"),
    "rope_scaling": ("changes", None, "the positions are encoded otherwise from this step on (a context extension)"),
    "tie_word_embeddings": ("shape", ("tie_word_embeddings", False), ""),
    "initializer_range": ("free", None, "it draws the weights of a fresh start only"),
    "dtype": ("changes", None, "the steps from here compute in it; the weights and moments stay float32"),
    "compile": ("free", None, "the same computation, compiled or not"),
    "init_from": ("free", None, "it is read at step 0 only"),
}
HF_MODEL_KEYS = {key: hf for key, (_, hf, _) in MODEL_KEYS.items() if hf is not None}


def _recorded(model: dict, key: str):
    """model[key] of a [model] section as Config.to_dict writes it (None dropped); absent: the key's default, which
    is what a checkpoint written before nanoflow had the key was trained with."""
    if key in model:
        return model[key]
    default = attrs.fields_dict(ModelArgs)[key].default
    return None if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]


def model_changes(saved: dict, current: dict) -> dict[str, list[str]]:
    """How the [model] section `current` differs from `saved`, the one a checkpoint's weights were trained under
    (both as Config.to_dict writes them): one line per key that differs, by its MODEL_KEYS role ("shape",
    "numbers": refused; "changes": warned of; "free": said). Pure: no IO."""
    changes: dict[str, list[str]] = {"shape": [], "numbers": [], "changes": [], "free": []}
    for key, (role, _, why) in MODEL_KEYS.items():
        was, now = _recorded(saved, key), _recorded(current, key)
        if was == now and isinstance(was, bool) == isinstance(now, bool):
            continue
        changes[role].append(f"model.{key} = {now!r} (was {was!r}): {why}" if why else
                             f"model.{key} was {was!r}, the config now says {now!r}"
                             + (" (the weights were trained under it)" if role == "numbers" else ""))
    return changes


def hf_config_mismatches(model: ModelArgs, hf: dict, source: str = "config.json") -> list[str]:
    """Every way an HF config.json (as a dict) differs from the [model] section, one line per key.

    Also names every config.json setting that would change the numbers and that nanoflow's Llama does
    not implement (from transformers' LlamaConfig: biases, another activation, attention dropout,
    pretraining_tp, head_dim, RoPE types other than default/linear/llama3, partial rotary; and what
    other architectures put in a llama-typed config: sliding windows, quantization).
    """
    problems = []
    for key, (hf_key, default) in HF_MODEL_KEYS.items():
        where = hf_key
        if hf_key in hf and hf[hf_key] is not None:
            value = hf[hf_key]
        else:
            value = hf.get("num_attention_heads", 32) if default is None else default
            where = f"{hf_key} (absent or null: transformers' default)"
        ours = getattr(model, key)
        if value != ours or isinstance(value, bool) != isinstance(ours, bool):
            problems.append(f"model.{key} = {ours!r}, but {source} has {where} = {value!r}")
    _, rope, theta_where = hf_rope(hf)
    if rope["rope_theta"] != model.rope_theta:
        problems.append(f"model.rope_theta = {model.rope_theta!r}, but {source} has {theta_where} = {rope['rope_theta']!r}")
    rope_problems, unsupported = _rope_mismatches(model, hf, source)
    problems += rope_problems
    if hf.get("model_type", "llama") != "llama":
        unsupported.append(f"model_type = {hf['model_type']!r} (nanoflow trains llama)")
    architectures = hf.get("architectures")
    if architectures and "LlamaForCausalLM" not in architectures:
        unsupported.append(f"architectures = {architectures!r} (nanoflow reads LlamaForCausalLM weights)")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):   # transformers maps both to SiLU
        unsupported.append(f"hidden_act = {hf['hidden_act']!r} (nanoflow's MLP uses silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias):
            unsupported.append(f"{bias} = true (nanoflow's projections have no bias)")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        unsupported.append(f"attention_dropout = {hf['attention_dropout']!r} (nanoflow trains without attention "
                           "dropout; set it to 0.0 in config.json to train without it)")
    if hf.get("pretraining_tp") not in (None, 1):
        unsupported.append(f"pretraining_tp = {hf['pretraining_tp']!r} (nanoflow computes each projection whole; "
                           "set it to 1 in config.json)")
    heads = hf.get("num_attention_heads")
    if hf.get("head_dim") is not None and heads and hf.get("hidden_size") and hf["head_dim"] != hf["hidden_size"] // heads:
        unsupported.append(f"head_dim = {hf['head_dim']} != hidden_size / num_attention_heads")
    if hf.get("use_sliding_window") or (hf.get("sliding_window") is not None and hf.get("use_sliding_window") is not False):
        unsupported.append(f"sliding_window = {hf.get('sliding_window')!r} (nanoflow attends to every earlier position)")
    layer_types = hf.get("layer_types")
    if isinstance(layer_types, list) and set(layer_types) - {"full_attention"}:
        unsupported.append(f"layer_types = {sorted(set(layer_types))!r} (nanoflow's layers all use full attention)")
    if hf.get("quantization_config"):
        unsupported.append("quantization_config (nanoflow trains unquantized weights)")
    problems += [f"{source}: {u}: not supported" for u in unsupported]
    return problems


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
        problems += _weight_problems("hf_dataset_or_datasets", list(name.items()))
        ends = dataset.dataset_weights_end
        if ends is not None:
            missing, extra = [n for n in name if n not in ends], [n for n in ends if n not in name]
            problems += [f"dataset_weights_end: no end weight for {n!r}; name every source of "
                         "hf_dataset_or_datasets" for n in missing]
            problems += [f"dataset_weights_end: {n!r} is not a source of hf_dataset_or_datasets" for n in extra]
            if not missing and not extra:
                problems += _weight_problems("dataset_weights_end", list(ends.items()))
    elif dataset.dataset_weights_end is not None:
        problems.append("dataset_weights_end: needs a {name = weight} table in hf_dataset_or_datasets (one dataset "
                        "has nothing to move between)")
    problems += _split_list_problems(dataset)
    for source, _ in dataset.weighted_names():
        location = locate_source(dataset, source)
        problems += location.messages()
        if not location.problems:
            problems += _missing_split_problems(dataset, source, location)
    if (dataset.prompt_column_name is None) != (dataset.completion_column_name is None):
        problems.append("an SFT stage needs both prompt_column_name and completion_column_name")
    return problems


def locate_source(dataset: DatasetArgs, name: str) -> Location:
    """Where one source of an HF dataset lies, by the definition the loader uses too."""
    in_table = isinstance(dataset.hf_dataset_or_datasets, dict)
    return locate(name, None if in_table else dataset.hf_data_files, in_table)


def _split_list_problems(dataset: DatasetArgs) -> list[str]:
    splits = dataset.hf_dataset_splits
    if isinstance(splits, str):
        return []
    if not splits:
        return ['hf_dataset_splits: an empty list; name the split to train on (e.g. "train")']
    if len(set(splits)) != len(splits):
        return [f"hf_dataset_splits: {splits!r} names a split twice"]
    if "train" not in splits:
        return [f'hf_dataset_splits: a list of splits trains on "train", as in nanotron, and {splits!r} does not '
                f'list it; to train on another split, name it alone (hf_dataset_splits = "{splits[0]}")']
    return []


def _missing_split_problems(dataset: DatasetArgs, name: str, location: Location) -> list[str]:
    """Every listed split must exist where the disk tells which splits a source has (local files: one, "train"; a
    DatasetDict saved to disk: its dataset_dict.json); a hub dataset's splits are checked when it is loaded."""
    listed = dataset.listed_splits
    if location.kind == "saved" and location.splits is None:   # a Dataset saved alone: one table, no split names
        if len(listed) > 1:
            return [f"hf_dataset_splits: {name} is one dataset saved without splits (a Dataset, not a DatasetDict), "
                    f"so it has no split {', '.join(map(repr, dataset.untrained_splits))} to load; "
                    f'name one split (hf_dataset_splits = "{dataset.train_split}")']
        return []
    if location.splits is None:
        return []
    missing = [split for split in listed if split not in location.splits]
    if not missing:
        return []
    if location.kind == "files":
        subject = f"{location.builder} files {', '.join(location.files[:3])}"
        what = 'local files make one split, "train"'
    else:
        subject, what = name, f"its splits are {', '.join(location.splits)}"
    return [f"hf_dataset_splits: no split {', '.join(map(repr, missing))} in {subject}: {what}"]


def _nanoset_problems(dataset: NanosetDatasetsArgs) -> list[str]:
    problems = [f"dataset_folder: {problem}" for folder in dataset.folders
                if (problem := token_folder_problem(folder)) is not None]
    if len(set(map(os.path.abspath, dataset.folders))) != len(dataset.folders):
        problems.append("dataset_folder: a folder is named twice")
    weights = dataset.dataset_weights
    if weights is not None:
        if len(weights) != len(dataset.folders):
            problems.append(f"dataset_weights: {len(weights)} weights for {len(dataset.folders)} folders")
        else:
            problems += _weight_problems("dataset_weights", list(zip(dataset.folders, weights)))
    ends = dataset.dataset_weights_end
    if ends is not None:
        if weights is None:
            problems.append("dataset_weights_end: needs dataset_weights, the weights at the stage's start")
        elif len(ends) != len(dataset.folders):
            problems.append(f"dataset_weights_end: {len(ends)} weights for {len(dataset.folders)} folders")
        else:
            problems += _weight_problems("dataset_weights_end", list(zip(dataset.folders, ends)))
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


def check_world_size(config: Config, world: str | None) -> None:
    """torchrun's WORLD_SIZE (None without torchrun: one process) must be parallelism.dp × parallelism.tp.
    Checked where the processes join (nanoflow.parallel.mesh.init_topology), not at load: a config for many
    processes loads, and --plan prints its plan, from a single one."""
    dp, tp = config.parallelism.dp, config.parallelism.tp
    if world in (None, "1") and dp * tp == 1 or world == str(dp * tp):
        return
    how = (f"launch with torchrun --nproc_per_node={dp * tp}" if world in (None, "1")
           else f"torchrun started {world} processes")
    raise ConfigError(f"parallelism.dp × parallelism.tp = {dp} × {tp} = {dp * tp} processes, but {how}")


# ---------------------------------------------------------------------------------------------
# [evaluation] and held_out_samples: every eval set names data that exists and is kept out of training

def _held_out_problems(config: Config) -> list[str]:
    """Stages that read one source must reserve the same held_out_samples of it: a stage that reserved none would
    train on the windows another keeps for evaluation (and continue_from would read on in another order)."""
    problems, reserved = [], {}
    for i, stage in enumerate(config.data_stages):
        dataset = stage.data.dataset
        for key in dataset.source_keys():
            first = reserved.setdefault(key, (stage.name, dataset.held_out_samples))
            if first[1] != dataset.held_out_samples:
                problems.append(
                    f'data_stages[{i}] (stage "{stage.name}").data.dataset.held_out_samples = '
                    f'{dataset.held_out_samples or "unset"}, but stage "{first[0]}" reads the same source with '
                    f'held_out_samples = {first[1] or "unset"}; stages that share a source must reserve the same '
                    "samples of it, or one trains on what another holds out")
    return problems


def evaluation_problems(config: Config) -> list[str]:
    """Every problem of [evaluation] that can be found without opening data."""
    evaluation = config.evaluation
    if evaluation is None:
        return []
    if not evaluation.datasets:
        return ["evaluation: no [[evaluation.datasets]] to evaluate; add one, or remove [evaluation]"]
    problems, seen = [], set()
    stages = {stage.name: stage for stage in config.data_stages}
    for i, entry in enumerate(evaluation.datasets):
        label = f'evaluation.datasets[{i}] ("{entry.name}")'
        if not entry.name.strip():
            problems.append(f"evaluation.datasets[{i}].name: empty; give each eval set a name")
        elif entry.name in seen:
            problems.append(f"{label}.name: another eval set is named \"{entry.name}\"; names must be unique")
        seen.add(entry.name)
        if (entry.dataset is None) == (entry.held_out_of is None):
            problems.append(f"{label}: give exactly one of a [evaluation.datasets.dataset] table and held_out_of "
                            "(a stage whose source reserves held_out_samples)")
            continue
        if entry.held_out_of is not None:
            stage = stages.get(entry.held_out_of)
            if stage is None:
                problems.append(f'{label}.held_out_of: no stage is named "{entry.held_out_of}" (stages: '
                                + ", ".join(stages) + ")")
                continue
            dataset = stage.data.dataset
            if dataset.held_out_samples is None:
                problems.append(f'{label}.held_out_of: stage "{stage.name}" reserves nothing; set its '
                                "data.dataset.held_out_samples = N to keep its last N samples out of training")
            own = config.stage_tokens(list(stages).index(stage.name)).sequence_length
            if entry.sequence_length not in (None, own):
                problems.append(f'{label}.sequence_length = {entry.sequence_length}, but stage "{stage.name}" cuts '
                                f"its windows (and so the held-out ones) at {own}; leave it unset")
        else:
            dataset = entry.dataset
            problems.extend(f"{label}.dataset: {p}" for p in _dataset_problems(dataset))
            if dataset.held_out_samples is not None:
                problems.append(f"{label}.dataset.held_out_samples: an eval set reads all of its dataset; to evaluate "
                                "a stage's reserved samples, use held_out_of = the stage's name")
            if isinstance(getattr(dataset, "hf_dataset_splits", None), list):
                problems.append(f"{label}.dataset.hf_dataset_splits: an eval set reads one split; name it "
                                '(e.g. hf_dataset_splits = "validation")')
        if entry.metric == "exact_match" and not dataset.is_sft:
            problems.append(f'{label}.metric = "exact_match" needs prompt/completion data (prompt_column_name and '
                            "completion_column_name): it compares the greedy answer to the completion")
        length = config.eval_sequence_length(entry)
        if length > config.model.max_position_embeddings:
            problems.append(f"{label}: sequence_length = {length} exceeds model.max_position_embeddings = "
                            f"{config.model.max_position_embeddings}")
        if config.parallelism.tp_mode == "REDUCE_SCATTER" and length % config.parallelism.tp:
            problems.append(f"{label}: sequence_length = {length} is not divisible by parallelism.tp = "
                            f'{config.parallelism.tp}, which parallelism.tp_mode = "REDUCE_SCATTER" needs')
    return problems


def unreached_stages(config: Config) -> list[str]:
    """Names of stages that start after train_steps: legal (a short trial of a long schedule), but worth a warning."""
    schedule = Schedule.from_config(config)
    return [s.name for i, s in enumerate(schedule.stages) if not stage_steps(schedule, i)]


def untrained_splits(config: Config) -> list[str]:
    """One line for each stage whose hf_dataset_splits lists splits it does not train on (a list trains on
    "train", as in nanotron), naming the eval sets that read them, if any."""
    lines = []
    for stage in config.data_stages:
        dataset = stage.data.dataset
        if isinstance(dataset, NanosetDatasetsArgs) or not dataset.untrained_splits:
            continue
        parts = []
        for split in dataset.untrained_splits:
            readers = [entry.name for entry in (config.evaluation.datasets if config.evaluation else ())
                       if isinstance(entry.dataset, DatasetArgs) and _same_data(entry.dataset, dataset)
                       and entry.dataset.hf_dataset_splits == split]
            parts.append(f'"{split}"' + (f" (eval set {', '.join(readers)})" if readers else " (not evaluated either)"))
        lines.append(f'stage "{stage.name}": hf_dataset_splits = {list(dataset.listed_splits)!r} trains on '
                     f'"{dataset.train_split}" only, as nanotron does; not trained on: {", ".join(parts)}')
    return lines


def _same_data(a: DatasetArgs, b: DatasetArgs) -> bool:
    return (a.hf_dataset_or_datasets, a.hf_data_files, a.hf_dataset_config_name) == \
        (b.hf_dataset_or_datasets, b.hf_data_files, b.hf_dataset_config_name)
