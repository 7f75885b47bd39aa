"""nanotron YAML config → nanoflow TOML config.

nanoflow's schema is nanotron's, key for key, except `[model]`, which is nanotron's
`model.model_config` (HF LlamaConfig names) flattened, plus `model.dtype`. So the converter
walks the YAML beside nanoflow's own config classes (nanoflow.config): a key nanoflow has is
carried over, a key it has not is named in the report with its value and, where known, why.
Nothing is dropped silently; a null value means "not set" and needs no report. A dropped key
whose value changes nothing in nanoflow (pp = 1, zero_stage = 0 …) is reported as "ignored".

    from nanoflow.nanotron import convert
    toml_text, report = convert(yaml.safe_load(open("config.yaml")))

Paths are carried over verbatim: nanotron reads them relative to the working directory, nanoflow
relative to the TOML file, so place the TOML accordingly or make them absolute.
"""

from __future__ import annotations

import json
import math
import re
import typing

import attrs

from nanoflow import config as schema

# Keys that have no nanoflow equivalent, with the reason shown in the report.
# data_stages[i] is written data_stages here.
REASONS = {
    "general.step": "the step comes from the checkpoint",
    "general.consumed_train_samples": "consumed samples come from the checkpoint",
    "general.benchmark_csv_path": "no benchmark CSV",
    "general.ignore_sanity_checks": "nanoflow always validates",
    "general.entity": "no experiment tracker",
    "model.init_method": "weights are drawn with model.initializer_range; for existing weights set model.init_from",
    "model.make_vocab_size_divisible_by": "set model.vocab_size to the padded size",
    "model.ddp_bucket_cap_mb": "FSDP2 does its own bucketing",
    "model.model_config.hidden_act": "nanoflow's MLP is always silu",
    "model.model_config.rope_scaling": "plain RoPE only",
    "model.model_config.rope_interleaved": "nanoflow uses HF's non-interleaved RoPE",
    "model.model_config.bos_token_id": "special tokens come from the tokenizer",
    "model.model_config.eos_token_id": "special tokens come from the tokenizer",
    "model.model_config.pad_token_id": "special tokens come from the tokenizer",
    "model.model_config.pretraining_tp": "an HF inference setting",
    "model.model_config.use_cache": "an HF inference setting",
    "model.model_config.is_llama_config": "every nanoflow model is a Llama",
    "tokenizer.tokenizer_revision": "tokenizers are local tokenizer.json files",
    "tokenizer.tokenizer_max_length": "sequence lengths come from [tokens] and the stages",
    "parallelism.pp": "nanoflow has no pipeline parallelism: dp and tp only",
    "parallelism.pp_engine": "no pipeline parallelism",
    "parallelism.expert_parallel_size": "no mixture of experts",
    "parallelism.context_parallel_size": "no context parallelism",
    "parallelism.recompute_layer": "no activation recomputation",
    "parallelism.tp_linear_async_communication": "PyTorch's DTensor tensor parallelism has no such switch",
    "parallelism.tp_recompute_allgather": "PyTorch's DTensor tensor parallelism has no such switch",
    "tokens.val_check_interval": "no validation loop",
    "tokens.limit_val_batches": "no validation loop",
    "tokens.limit_test_batches": "no validation loop",
    "optimizer.zero_stage": "FSDP2 shards parameters, gradients and optimizer state over dp",
    "optimizer.accumulate_grad_in_fp32": "master weights and gradients are float32",
    "optimizer.weight_decay_exclude_named_params": "1-D parameters (norms) are never decayed",
    "checkpoints.save_initial_state": "not supported",
    "checkpoints.save_final_state": "the last step is always saved",
    "checkpoints.checkpoints_path_is_shared_file_system": "not needed: every rank writes its own files",
    "logging.log_level": "nanoflow logs progress lines, not levels",
    "logging.log_level_replica": "nanoflow logs progress lines, not levels",
    "data_stages.data.dataset.hf_dataset_or_datasets": "a dataset name, or a {name = weight} table to blend",
    "data_stages.data.dataset.dataset_max_tokens": "not supported",
    "data_stages.data.dataset.return_positions": "not supported",
    "data_stages.data.dataset.pad_samples_to_global_batch_size": "not supported",
    "lighteval": "no evaluation hook; run lighteval on an exported model (bin/export)",
    "profiler": "no profiler hook",
    "s3_upload": "set checkpoints.checkpoints_path = \"s3://bucket/prefix\" to write checkpoints to S3 directly",
    "kill_switch_path": "send SIGTERM or SIGUSR1 to stop cleanly",
    "metrics_logging": "metrics go to metrics.jsonl and TensorBoard",
}

# Values of dropped keys that change nothing in nanoflow (None: any value is harmless).
NEUTRAL = {
    "general.ignore_sanity_checks": None, "general.benchmark_csv_path": None, "general.entity": None,
    "model.ddp_bucket_cap_mb": None, "model.make_vocab_size_divisible_by": 1,
    "model.model_config.bos_token_id": None, "model.model_config.eos_token_id": None,
    "model.model_config.pad_token_id": None, "model.model_config.pretraining_tp": 1,
    "model.model_config.use_cache": None, "model.model_config.is_llama_config": True,
    "parallelism.pp": 1, "parallelism.pp_engine": None, "parallelism.expert_parallel_size": 1,
    "parallelism.context_parallel_size": 1, "parallelism.recompute_layer": False,
    "parallelism.tp_linear_async_communication": None, "parallelism.tp_recompute_allgather": None,
    "tokens.val_check_interval": -1, "tokens.limit_val_batches": 0, "tokens.limit_test_batches": 0,
    "optimizer.zero_stage": 0, "optimizer.accumulate_grad_in_fp32": True,
    "checkpoints.save_initial_state": False, "checkpoints.save_final_state": None,
    "checkpoints.checkpoints_path_is_shared_file_system": None,
    "logging.log_level": None, "logging.log_level_replica": None,
    "tokenizer.tokenizer_revision": None, "tokenizer.tokenizer_max_length": None,
}

SECTIONS = ("general", "model", "tokenizer", "parallelism", "tokens", "optimizer", "checkpoints", "logging")


def _generic(key: str) -> str:
    return re.sub(r"data_stages\[\d+\]", "data_stages", key)


def _neutral(key: str, value) -> bool:
    key = _generic(key)
    if key not in NEUTRAL:
        return False
    return NEUTRAL[key] is None or (value == NEUTRAL[key] and type(value) is type(NEUTRAL[key]))


@attrs.frozen
class Report:
    """What the conversion did not carry over (`dropped`: (dotted key, value, reason)) and what it changed (`notes`)."""

    dropped: tuple[tuple[str, object, str], ...]
    notes: tuple[str, ...]

    def lines(self) -> list[str]:
        """One line per dropped key ("ignored" where the value changes nothing), then the notes."""
        out = []
        for key, value, why in self.dropped:
            verb = "ignored" if _neutral(key, value) else "not carried over"
            out.append(f"{verb}: {key} = {_show(value)}" + (f" ({why})" if why else ""))
        return out + [f"note: {note}" for note in self.notes]


def _show(value) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


_SKIP = object()


class _Walk:
    def __init__(self):
        self.dropped: list[tuple[str, object, str]] = []
        self.notes: list[str] = []

    def drop(self, key: str, value, why: str | None = None) -> None:
        if value is not None:
            self.dropped.append((key, value, REASONS.get(key) or REASONS.get(_generic(key)) or why or ""))

    def table(self, raw, cls, path: str) -> dict:
        """Carry the keys of `raw` that attrs class `cls` has (recursing into nested classes); report the rest."""
        if not isinstance(raw, dict):
            self.drop(path, raw, "expected a mapping")
            return {}
        fields = [f.name for f in attrs.fields(cls)]
        hints = typing.get_type_hints(cls)
        out = {}
        for key, value in raw.items():
            where = f"{path}.{key}" if path else str(key)
            if value is None:
                continue
            if key not in fields:
                self.drop(where, value)
                continue
            converted = self.value(value, hints[key], where)
            if converted is not _SKIP:
                out[key] = converted
        return {name: out[name] for name in fields if name in out}   # nanoflow's order, as in its docs

    def value(self, value, hint, where: str):
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if attrs.has(hint):
            return self.table(value, hint, where)
        if origin is typing.Union:
            options = [a for a in args if a is not type(None)]
            classes = [o for o in options if attrs.has(o)]
            if classes and isinstance(value, dict):   # the class that knows most of the keys (Nanoset vs HF datasets)
                return self.table(value, max(classes, key=lambda c: len(set(value) & set(attrs.fields_dict(c)))), where)
            for option in options:
                if _fits(value, option):
                    return self.value(value, option, where)
            if len(options) == 1:
                return self.value(value, options[0], where)
            self.drop(where, value, f"nanoflow expects {' or '.join(_name(o) for o in options)}")
            return _SKIP
        if origin is typing.Literal:
            if value in args:
                return value
            self.drop(where, value, f"nanoflow supports {', '.join(map(repr, args))}")
            return _SKIP
        if hint is float and isinstance(value, str):
            try:   # YAML 1.1 reads 1e-5 (no dot) as a string; nanotron's own dumps write 1.0e-05
                number = float(value)
            except ValueError:
                pass
            else:
                self.notes.append(f"{where} = {value!r}: read as the number {number!r}")
                return number
        if not _fits(value, hint):
            self.drop(where, value, f"nanoflow expects {_name(hint)}")
            return _SKIP
        if hint is float:
            return float(value)
        if origin is dict and args[1] is float:
            return {str(k): float(v) for k, v in value.items()}
        if origin is list and args[0] is float:
            return [float(v) for v in value]
        return value


def _name(hint) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint).replace("typing.", "")


def _fits(value, hint) -> bool:
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (str, bool):
        return isinstance(value, hint)
    if attrs.has(hint):
        return isinstance(value, dict)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and bool(value) and all(_fits(k, args[0]) and _fits(v, args[1])
                                                              for k, v in value.items())
    if origin is typing.Literal:
        return value in args
    if origin is typing.Union:
        return any(_fits(value, a) for a in args)
    return False


def convert(nanotron: dict) -> tuple[str, Report]:
    """A nanotron config (the YAML, parsed) as nanoflow TOML text, and what could not be carried over.

    The TOML starts with a comment naming what was not carried over, so the file itself keeps the record.
    """
    if not isinstance(nanotron, dict):
        raise ValueError("a nanotron config is a YAML mapping at the top level")
    walk = _Walk()
    out: dict = {}
    hints = typing.get_type_hints(schema.Config)
    for section in SECTIONS:
        if nanotron.get(section) is None:
            continue
        if section == "model":
            out["model"] = _model(walk, nanotron["model"])
        elif section == "optimizer":
            out["optimizer"] = _optimizer(walk, nanotron["optimizer"])
        else:
            out[section] = walk.table(nanotron[section], hints[section], section)
    stages = nanotron.get("data_stages")
    if stages is None and nanotron.get("data") is not None:   # nanotron before data_stages: one stage
        stages = [{"name": "stable", "start_training_step": 1, "data": nanotron["data"]}]
        walk.notes.append('data (no data_stages): converted to one stage named "stable" from step 1')
    elif nanotron.get("data") is not None:
        walk.drop("data", nanotron["data"], "data_stages is set, and nanotron uses it instead")
    if isinstance(stages, list):
        out["data_stages"] = [walk.table(stage, schema.DatasetStageArgs, f"data_stages[{i}]")
                              for i, stage in enumerate(stages)]
    elif stages is not None:
        walk.drop("data_stages", stages, "expected a list of stages")
    for key, value in nanotron.items():
        if key not in (*SECTIONS, "data_stages", "data"):
            walk.drop(str(key), value)
    _path_notes(walk, out)
    report = Report(tuple(walk.dropped), tuple(walk.notes))
    header = "".join(f"# {line}\n" for line in report.lines() if not line.startswith("ignored:"))
    return "# Converted from a nanotron config by bin/convert-nanotron-config.\n" + header + "\n" + to_toml(out), report


def _model(walk: _Walk, model) -> dict:
    if not isinstance(model, dict):
        walk.drop("model", model, "expected a mapping")
        return {}
    model_config = dict(model.get("model_config") or {})
    for key in ("dtype", "init_from", "compile"):   # nanoflow [model] keys that are not LlamaConfig fields
        if model_config.get(key) is not None:
            walk.drop(f"model.model_config.{key}", model_config.pop(key), "not a LlamaConfig field")
    if model_config.get("hidden_act") == "silu":   # what nanoflow does: nothing to report
        del model_config["hidden_act"]
    if model_config.get("rope_interleaved") is False:
        del model_config["rope_interleaved"]
    out = walk.table(model_config, schema.ModelArgs, "model.model_config")
    for key, value in model.items():
        if key == "model_config" or value is None:
            continue
        if key == "dtype":
            dtype = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}.get(
                str(value).removeprefix("torch."))
            if dtype is None:
                walk.drop("model.dtype", value, "nanoflow trains in float32 or with bfloat16 autocast")
            else:
                out["dtype"] = dtype
        elif key == "init_method" and isinstance(value, dict) and set(value) == {"std"} and _fits(value["std"], float):
            out["initializer_range"] = float(value["std"])
            walk.notes.append(f"model.init_method.std = {value['std']} → model.initializer_range "
                              "(the std nanotron draws the weights with)")
        else:
            walk.drop(f"model.{key}", value)
    return out


def _optimizer(walk: _Walk, optimizer) -> dict:
    if not isinstance(optimizer, dict):
        walk.drop("optimizer", optimizer, "expected a mapping")
        return {}
    optimizer = dict(optimizer)
    # Older nanotron: adam_* at the top of optimizer, no optimizer_factory.
    legacy = {k: optimizer.pop(k) for k in ("adam_beta1", "adam_beta2", "adam_eps", "torch_adam_is_fused")
              if k in optimizer}
    if legacy:
        factory = dict(optimizer.get("optimizer_factory") or {})
        factory.setdefault("name", "adamW")
        for key, value in legacy.items():
            factory.setdefault(key, value)
        optimizer["optimizer_factory"] = factory
        walk.notes.append(f"optimizer.{{{', '.join(legacy)}}} → optimizer.optimizer_factory")
    return walk.table(optimizer, schema.OptimizerArgs, "optimizer")


def _path_notes(walk: _Walk, out: dict) -> None:
    checkpoints, tokenizer = out.get("checkpoints", {}), out.get("tokenizer", {})
    paths = [checkpoints.get("checkpoints_path"), checkpoints.get("resume_checkpoint_path")]
    for i, stage in enumerate(out.get("data_stages", [])):
        dataset = stage.get("data", {}).get("dataset", {})
        for key in ("hf_data_files", "dataset_folder"):
            value = dataset.get(key)
            paths += value if isinstance(value, list) else [value]
        blend = dataset.get("hf_dataset_or_datasets")
        if isinstance(blend, dict) and ("hf_data_files" in dataset or set(blend) & set(schema.BUILDERS)):
            walk.notes.append(f"data_stages[{i}].data.dataset: a {{name = weight}} table names each part's files in "
                              'its key (e.g. "sft/*.jsonl" = 1.0), without hf_data_files or a bare builder name '
                              "such as json: rewrite it so, or the config will not load")
    if any(isinstance(p, str) and "://" not in p and not p.startswith("/") for p in paths):
        walk.notes.append("relative paths are carried verbatim: nanoflow reads them relative to the TOML file, "
                          "nanotron relative to the working directory")
    name = tokenizer.get("tokenizer_name_or_path")
    if isinstance(name, str) and name != "bytes" and not name.endswith(".json"):
        walk.notes.append(f"tokenizer.tokenizer_name_or_path = {name!r}: nanoflow loads a local tokenizer.json "
                          '(or a folder holding one), not a Hub name; download it and point there, or use "bytes"')


# ---------------------------------------------------------------------------------------------
# A TOML emitter for the values a config holds: tables, arrays of tables, scalars and arrays of scalars.

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _string(key)


def _string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters (DEL too) escaped, the rest literal."""
    return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in text) + '"'


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_scalar(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _is_table_array(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, dict) for v in value)


def _is_table(key: str, value) -> bool:
    return isinstance(value, dict) and not _inline(key, value)


def _inline(key: str, value) -> bool:
    """A {name = weight} blend is written inline: it is a value, not a section."""
    return key == "hf_dataset_or_datasets"


def to_toml(data: dict) -> str:
    """`data` as TOML text: a table's scalars first, then its [tables] and [[arrays of tables]], in the order given."""
    lines: list[str] = []
    _emit(data, [], lines)
    return "\n".join(lines).strip("\n") + "\n"


def _emit(table: dict, path: list[str], lines: list[str], header: str | None = None) -> None:
    if header is not None:
        lines += ["", header]
    for key, value in table.items():
        if value is not None and not _is_table(key, value) and not _is_table_array(value):
            lines.append(f"{_key(key)} = {_scalar(value)}")
    for key, value in table.items():
        dotted = path + [_key(key)]
        if _is_table(key, value):
            has_values = any(v is not None and not _is_table(k, v) and not _is_table_array(v) for k, v in value.items())
            # A table holding only sub-tables needs no header of its own (theirs define it).
            _emit(value, dotted, lines, f"[{'.'.join(dotted)}]" if has_values or not value else None)
        elif _is_table_array(value):
            for item in value:
                _emit(item, dotted, lines, f"[[{'.'.join(dotted)}]]")
