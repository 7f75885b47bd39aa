"""Checks across keys: everything that can be found wrong before loading data or building the model.

`validate` is the one entry point (load_config calls it); the checks of [model] against other descriptions of
the model are in model_checks, those of the data a config names in data_checks.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import attrs

from nanoflow.config.data_checks import (
    continue_from_problems,
    dataset_problems,
    evaluation_problems,
    held_out_problems,
    locate_source,
    untrained_splits,
)
from nanoflow.config.families import complete, family_problems, fresh_problems, unset_required
from nanoflow.config.model_checks import (
    MODEL_KEYS,
    hf_rope,
    model_changes,
    model_from_hf,
    recorded_model,
    recorded_stage_ropes,
    trained_rope,
)
from nanoflow.config.rope import ROPE_KEYS, Rope, rope_scaling_problems, stage_rope
from nanoflow.config.schema import Config, ConfigError
from nanoflow.lr import resolve_stage_lr, stage_span
from nanoflow.schedule import Schedule, ScheduleError, stage_steps

__all__ = ["MODEL_KEYS", "ROPE_KEYS", "Rope", "check_world_size", "complete_model", "evaluation_problems", "hf_rope",
           "locate_source", "model_changes", "model_from_hf", "model_problems", "recorded_model", "recorded_stage_ropes",
           "rope_scaling_problems", "stage_rope", "trained_rope", "unreached_stages", "untrained_splits", "validate"]

# ---------------------------------------------------------------------------------------------
# Validation across keys

def validate(config: Config) -> list[str]:
    """Every problem that can be found without loading data or building the model: each rule's of RULES, in order."""
    return [problem for rule in RULES for problem in rule(config)]


def _stage_label(config: Config, index: int) -> str:
    return f'data_stages[{index}] (stage "{config.data_stages[index].name}")'


def _complete_model_problems(config: Config) -> list[str]:
    """model_problems, once every key it reads is set; else open_run completes [model] (from init_from's
    config.json) and checks it then."""
    model = config.model
    complete = (not unset_required(model) and model.model_type is not None and model.num_key_value_heads is not None
                and model.max_position_embeddings is not None)
    return model_problems(config) if complete else []


def _batch_size_problems(config: Config, index: int) -> list[str]:
    """A stated global_batch_size must be what micro_batch_size × batch_accumulation_per_replica × dp make (or,
    with the accumulation unstated, a multiple of micro_batch_size × dp, from which the accumulation follows)."""
    tokens, dp = config.stage_tokens(index), config.parallelism.dp
    assert tokens.batch_accumulation_per_replica is not None   # stage_tokens resolves it
    if tokens.global_batch_size is None:
        return []
    derived = tokens.micro_batch_size * tokens.batch_accumulation_per_replica * dp
    accumulation_stated = (config.data_stages[index].batch_accumulation_per_replica is not None
                           or config.tokens.batch_accumulation_per_replica is not None)
    if not accumulation_stated and tokens.global_batch_size % (tokens.micro_batch_size * dp):
        return [f"{_stage_label(config, index)}: global_batch_size = {tokens.global_batch_size} is not a multiple of "
                f"micro_batch_size × dp = {tokens.micro_batch_size} × {dp}"]
    if tokens.global_batch_size != derived:
        return [f"{_stage_label(config, index)}: global_batch_size = {tokens.global_batch_size}, but "
                f"micro_batch_size × batch_accumulation_per_replica × dp = {tokens.micro_batch_size} × "
                f"{tokens.batch_accumulation_per_replica} × {dp} = {derived}"]
    return []


def _stage_dataset_problems(config: Config, index: int) -> list[str]:
    return [f"{_stage_label(config, index)}.data.dataset: {p}"
            for p in dataset_problems(config.data_stages[index].data.dataset)]


def _stage_continue_from_problems(config: Config, index: int) -> list[str]:
    return [f"{_stage_label(config, index)}.data.continue_from: {p}" for p in continue_from_problems(config, index)]


def _stage_rope_problems(config: Config, index: int) -> list[str]:
    return rope_scaling_problems(config.data_stages[index].rope_scaling, f"{_stage_label(config, index)}.rope_scaling")


# What each stage is checked for, stage by stage, in this order.
STAGE_RULES: tuple[Callable[[Config, int], list[str]], ...] = (
    _batch_size_problems, _stage_dataset_problems, _stage_continue_from_problems, _stage_rope_problems)


def _stages_problems(config: Config) -> list[str]:
    return [problem for index in range(len(config.data_stages)) for rule in STAGE_RULES
            for problem in rule(config, index)]


def _sequence_parallel_problems(config: Config) -> list[str]:
    """Under tp_mode = "REDUCE_SCATTER" each tp rank holds sequence_length / tp positions between the blocks."""
    par = config.parallelism
    if par.tp_mode != "REDUCE_SCATTER":
        return []
    return [f"{_stage_label(config, index)}: sequence_length = {length} is not divisible by "
            f'parallelism.tp = {par.tp}, which parallelism.tp_mode = "REDUCE_SCATTER" needs'
            for index in range(len(config.data_stages))
            if (length := config.stage_tokens(index).sequence_length) % par.tp]


def _tokenizer_problems(config: Config) -> list[str]:
    path = config.tokenizer.tokenizer_name_or_path
    if path == "bytes" or os.path.exists(path):
        return []
    return [f"tokenizer.tokenizer_name_or_path: {path} does not exist"]


def _model_rope_problems(config: Config) -> list[str]:
    return rope_scaling_problems(config.model.rope_scaling)


def _schedule_problems(config: Config) -> list[str]:
    """The stages as a schedule (their order, start steps and names; nanoflow.schedule), then each stage's own LR
    schedule within its steps."""
    try:
        schedule = Schedule.from_config(config)
    except ScheduleError as e:
        # The last stage of that name: for a duplicate name, the second one is the culprit.
        culprit = next((i for i, s in reversed(list(enumerate(config.data_stages))) if s.name == e.stage), None)
        key = "start_training_step" if e.key == "start_step" else e.key
        prefix = f"{_stage_label(config, culprit)}.{key}" if culprit is not None else (
            "tokens.train_steps" if e.key == "train_steps" else e.key)
        return [f"{prefix}: {e}"]
    return [f"{_stage_label(config, i)}.learning_rate_scheduler.{p}"
            for i in range(len(config.data_stages)) for p in _stage_lr_problems(config, schedule, i)]


def complete_model(config: Config, hf: dict | None = None, source: str = "config.json") -> Config:
    """`config` with its [model] complete: read from `hf`, the config.json of an HF model folder named by
    model.init_from (as a dict; keys [model] gives must agree), else with nanoflow's defaults for a fresh model.
    Raises one ConfigError naming every problem, of the completion and then of the completed config (validate)."""
    if hf is not None:
        model, problems = model_from_hf(config.model, hf, source)
        problems = [f"model.init_from: {p}" for p in problems]
    else:
        problems = fresh_problems(config.model)
        model = config.model if problems else complete(config.model)
    if not problems:
        config = attrs.evolve(config, model=model)
        problems = validate(config)
    if problems:
        raise ConfigError("\n  ".join(problems))
    return config


def model_problems(config: Config) -> list[str]:
    """What is wrong with a complete [model] on its own and against the run: head counts, the family's keys, the
    longest sequence against max_position_embeddings and a sliding window, the heads against tp."""
    model, par = config.model, config.parallelism
    assert (model.num_attention_heads is not None and model.num_key_value_heads is not None
            and model.max_position_embeddings is not None)   # a complete [model]: every key set
    problems = family_problems(model, par.tp)
    if model.num_attention_heads % model.num_key_value_heads:
        problems.append(f"model.num_attention_heads = {model.num_attention_heads} is not divisible by "
                        f"model.num_key_value_heads = {model.num_key_value_heads}")
    for key in ("num_attention_heads", "num_key_value_heads"):
        if getattr(model, key) % par.tp:
            problems.append(f"model.{key} = {getattr(model, key)} is not divisible by parallelism.tp = {par.tp}")
    lengths = [("tokens", config.tokens.sequence_length)]
    lengths += [(f'data_stages[{i}] (stage "{stage.name}")', config.stage_tokens(i).sequence_length)
                for i, stage in enumerate(config.data_stages) if stage.sequence_length is not None]
    if config.evaluation is not None:
        lengths += [(f'evaluation.datasets[{i}] ("{entry.name}")', config.eval_sequence_length(entry))
                    for i, entry in enumerate(config.evaluation.datasets)]
    for where, length in lengths:
        if length > model.max_position_embeddings:
            problems.append(f"{where}: sequence_length = {length} exceeds model.max_position_embeddings = "
                            f"{model.max_position_embeddings}")
        if model.sliding_window and length > model.sliding_window:
            problems.append(f"{where}: sequence_length = {length} is longer than model.sliding_window = "
                            f"{model.sliding_window} ({model.model_type}): nanoflow attends to every earlier position, "
                            "so it reproduces a sliding window only as long as every sequence")
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
    problem = run_name_problem("general.run", config.general.run)
    if problem is not None:
        problems.append(f"{problem}; where it writes is checkpoints.checkpoints_path")
    return problems


def run_name_problem(key: str, name) -> str | None:
    """Why `name` (at `key`) is no run's name — a path would write elsewhere: '/' or '\\' in it, '.', '..', empty —
    or None when it is one. The one rule for run names: general.run, and bin/sweep's runs and averages."""
    if not isinstance(name, str):
        return f"{key}: a run's name (a string), not {name!r}"
    if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        return f"{key} = {name!r}: a run's name, not a path (no '/', not '.' or '..', not empty)"
    return None


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


def unreached_stages(config: Config) -> list[str]:
    """Names of stages that start after train_steps: legal (a short trial of a long schedule), but worth a warning."""
    schedule = Schedule.from_config(config)
    return [s.name for i, s in enumerate(schedule.stages) if not stage_steps(schedule, i)]


# The rules validate applies, in this order (the order its problems are listed in).
RULES: tuple[Callable[[Config], list[str]], ...] = (
    _complete_model_problems, _stages_problems, _sequence_parallel_problems, _tokenizer_problems,
    _model_rope_problems, _run_place_problems, held_out_problems, evaluation_problems, _schedule_problems)
