"""nanotron YAML config → nanoflow TOML config.

nanoflow's schema is nanotron's, key for key, except `[model]`, which is nanotron's
`model.model_config` (HF config.json names) flattened, plus `model.dtype`; the model family follows from
nanotron's model config class and the keys that change its decoder (_family). So the converter
walks the YAML beside nanoflow's own config classes (nanoflow.config): a key nanoflow has is
carried over, a key it has not is named in the report with its value and, where known, why.
Nothing is dropped silently; a null value means "not set" and needs no report. A dropped key
whose value changes nothing in nanoflow (pp = 1, zero_stage = 0 …) is reported as "ignored".

    from nanoflow.interop.nanotron import convert
    from nanoflow.interop.nanotron_yaml import read_nanotron_yaml
    toml_text, report = convert(read_nanotron_yaml("config.yaml"))   # yaml.safe_load, bounded

Paths are carried over verbatim: nanotron reads them relative to the working directory, nanoflow
relative to the TOML file, so place the TOML accordingly or make them absolute.
"""

from __future__ import annotations

import json
import re
import typing

import attrs

from nanoflow import config as schema
from nanoflow.config.checks import ROPE_KEYS
from nanoflow.config.keys import is_union
from nanoflow.errors import NanotronConfigError
from nanoflow.interop.nanotron_keys import (
    LR_SHIFT,
    MODEL_CONFIG_FIELDS,
    MODEL_CONFIG_FLAGS,
    MODEL_DEFAULTS,
    NANOTRON_DATA_SEED,
    NANOTRON_DTYPE,
    NEUTRAL,
    QWEN2_FIELDS,
    REASONS,
)
from nanoflow.interop.toml_writer import to_toml
from nanoflow.io.store import is_remote

__all__ = ["Report", "convert", "to_toml"]

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


class _Conversion:
    """A conversion under way: it walks the YAML beside nanoflow's config classes, carrying what fits and
    recording what it drops (with why) and what it changes, for the Report."""

    def __init__(self):
        self.dropped: list[tuple[str, object, str]] = []
        self.notes: list[str] = []
        self.document_masking: bool | None = None   # the model's _use_doc_masking, which nanoflow's [tokens] holds

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

    def value(self, value, hint, where: str):  # noqa: C901 - one branch per kind of type hint: a dispatch table
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if attrs.has(hint):
            return self.table(value, hint, where)
        if is_union(hint):
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
    return str(getattr(hint, "__name__", None)) if typing.get_origin(hint) is None else str(hint).replace("typing.", "")


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
    if is_union(hint):
        return any(_fits(value, a) for a in args)
    return False


def convert(nanotron: dict) -> tuple[str, Report]:
    """A nanotron config (the YAML, parsed) as nanoflow TOML text, and what could not be carried over.

    A key the YAML leaves unset gets nanotron's meaning, written out. The TOML starts with a comment
    naming what was not carried over, so the file itself keeps the record.
    """
    if not isinstance(nanotron, dict):
        raise NanotronConfigError("a nanotron config is a YAML mapping at the top level")
    record = _Conversion()
    out: dict = {}
    hints = typing.get_type_hints(schema.Config)
    for section in SECTIONS:
        if nanotron.get(section) is None:
            continue
        if section == "model":
            out["model"] = _model(record, nanotron["model"])
        elif section == "optimizer":
            out["optimizer"] = _optimizer(record, nanotron["optimizer"], nanotron.get("tokens"))
        elif section == "parallelism":
            out["parallelism"] = record.table(_upper_tp_mode(nanotron["parallelism"]), hints[section], section)
        else:
            out[section] = record.table(nanotron[section], hints[section], section)
    stages = nanotron.get("data_stages")
    if stages is None and nanotron.get("data") is not None:   # nanotron before data_stages: one stage
        stages = [{"name": "stable", "start_training_step": 1, "data": nanotron["data"]}]
        record.notes.append('data (no data_stages): converted to one stage named "stable" from step 1')
    elif nanotron.get("data") is not None:
        record.drop("data", nanotron["data"], "data_stages is set, and nanotron uses it instead")
    if isinstance(stages, list):
        out["data_stages"] = [_stage(record, stage, i) for i, stage in enumerate(stages)]
    elif stages is not None:
        record.drop("data_stages", stages, "expected a list of stages")
    for key, value in nanotron.items():
        if key not in (*SECTIONS, "data_stages", "data"):
            record.drop(str(key), value)
    if record.document_masking:   # nanotron's switch is the model's; nanoflow's is the data's, as it makes the positions
        out.setdefault("tokens", {})["document_masking"] = True
        record.notes.append("model.model_config._use_doc_masking = true → tokens.document_masking = true (every "
                            "stage; a stage may set its own)")
    evaluation = _split_eval_sets(record, out.get("data_stages", []))
    if evaluation:
        out["evaluation"] = {"datasets": evaluation}
    _fit_positions(record, out)
    _path_notes(record, out)
    report = Report(tuple(record.dropped), tuple(record.notes))
    header = "".join(f"# {line}\n" for line in report.lines() if not line.startswith("ignored:"))
    return ("# Converted from a nanotron config by bin/convert-nanotron-config.\n" + LR_SHIFT + header + "\n"
            + to_toml(out)), report


# ---------------------------------------------------------------------------------------------
# nanotron's meaning of a key the YAML leaves unset (or null): written out (nanotron_keys has the values)

def _unset(raw, key: str) -> bool:
    return not isinstance(raw, dict) or raw.get(key) is None


def _fill(record: _Conversion, out: dict, where: str, key: str, value, why: str) -> None:
    out[key] = value
    record.notes.append(f"{where}.{key} unset: written as {_show(value)} ({why})")


def _model(record: _Conversion, model) -> dict:
    if not isinstance(model, dict):
        record.drop("model", model, "expected a mapping")
        return {}
    model_config = dict(model.get("model_config") or {})
    _refuse_other_models(model_config)
    for key in ("dtype", "init_from", "compile"):   # nanoflow [model] keys that are not LlamaConfig fields
        if model_config.get(key) is not None:
            record.drop(f"model.model_config.{key}", model_config.pop(key), "not a LlamaConfig field")
    if model_config.get("hidden_act") == "silu":   # what nanoflow does: nothing to report
        del model_config["hidden_act"]
    if model_config.get("rope_interleaved") is False:
        del model_config["rope_interleaved"]
    masking = model_config.pop("_use_doc_masking", None)
    if isinstance(masking, bool):
        record.document_masking = masking
    else:
        record.drop("model.model_config._use_doc_masking", masking, "expected true or false")
    rope = _rope_scaling(record, model_config.pop("rope_scaling", None),
                         model_config.pop("rope_seq_len_interpolation_factor", None))
    family = _family(record, model_config)   # before the table: attention_bias means another thing per class
    out = {**record.table(model_config, schema.ModelArgs, "model.model_config"), **family}
    for key, default in MODEL_DEFAULTS.items():
        if _unset(model_config, key):
            _fill(record, out, "model.model_config", key, default, "nanotron's LlamaConfig default")
    if _unset(model_config, "num_key_value_heads") and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]   # nanotron's default and nanoflow's: no note
    out.update(_model_args(record, model))
    if _unset(model, "dtype"):
        _fill(record, out, "model", "dtype", NANOTRON_DTYPE, "nanotron's ModelArgs default; nanoflow's is \"auto\": "
              "bfloat16 on CUDA, float32 on a CPU")
    out = _in_order(out, schema.ModelArgs)
    if rope is not None:
        out["rope_scaling"] = rope
    return out


def _family(record: _Conversion, model_config: dict) -> dict:
    """The [model] keys of the nanoflow family nanotron's model config builds, its keys that say so taken out of
    `model_config`. nanotron's Llama builds every projection without a bias (its attention_bias is read by nothing);
    its Qwen2 (models/qwen.py) biases q, k and v with attention_bias (nanoflow's qwen2), skips RoPE in every layer
    i with i + 1 a multiple of no_rope_layer (SmolLM3's no_rope_layer_interval: nanoflow's smollm3) and attends
    to the last sliding_window_size positions with sliding_window_size (nanoflow's mistral when there are neither
    biases nor NoPE layers)."""
    where = "model.model_config"
    bias = model_config.pop("attention_bias", None)
    qwen2 = model_config.get("is_llama_config") is not True and any(
        model_config.get(key) is not None for key in QWEN2_FIELDS)
    if not qwen2:
        if bias:
            record.notes.append(f"{where}.attention_bias = true: nanotron's Llama builds its projections without "
                                "biases whatever it says, and so does nanoflow's llama")
        return {}
    nope, window = model_config.pop("no_rope_layer", None), model_config.pop("sliding_window_size", None)
    if nope is not None and not _fits(nope, int):
        record.drop(f"{where}.no_rope_layer", nope, "expected a number of layers")
        nope = None
    out = {}
    if nope is not None:
        out = {"model_type": "smollm3", "no_rope_layer_interval": nope}
        record.notes.append(f"{where}.no_rope_layer = {nope} → model_type = \"smollm3\", no_rope_layer_interval = "
                            f"{nope} (every layer i with i + 1 a multiple of {nope} takes no RoPE, as in nanotron)")
        record.drop(f"{where}.attention_bias", bias or None)
    elif bias:
        out = {"model_type": "qwen2"}
        record.notes.append(f'{where}.attention_bias = true → model_type = "qwen2" (biases on q, k and v)')
    if window is not None and not out and _fits(window, int) and window > 0:
        out = {"model_type": "mistral", "sliding_window": window}
        record.notes.append(f'{where}.sliding_window_size = {window} → model_type = "mistral", sliding_window = '
                            f"{window}: nanoflow attends to every earlier position, so every sequence_length must be at "
                            "most the window (the config refuses to load otherwise)")
    else:
        record.drop(f"{where}.sliding_window_size", window)
    return out


def _refuse_other_models(model_config: dict) -> None:
    """A model config nanotron reads as another class than its Llama or Qwen2 (by its flag, or by fields only that
    class has), or with a flag the converter does not know, is refused by name: carried over key for key it would
    become a Llama of LlamaConfig's default shape."""
    flags = [key for key, value in model_config.items()
             if isinstance(key, str) and re.fullmatch(r"is_\w+_config", key) and value is True]
    moe = model_config.get("moe_config")
    if moe is not None and not (isinstance(moe, dict) and moe.get("layers") == []):   # MoEConfig.layers: [] is none
        raise NanotronConfigError("model.model_config.moe_config: nanotron's Qwen2 with mixture-of-experts layers; "
                                  "nanoflow trains dense models, so it cannot be converted")
    for flag in flags:
        if flag not in MODEL_CONFIG_FLAGS:
            known = ", ".join(name for name, _ in MODEL_CONFIG_FLAGS.values())
            raise NanotronConfigError(f"model.model_config.{flag} = true: a model config the converter does not know "
                                      f"(nanotron's are {known}); nanoflow converts nanotron's LlamaConfig and "
                                      "Qwen2Config only")
    for flag, (name, why) in MODEL_CONFIG_FLAGS.items():
        own = [key for key in MODEL_CONFIG_FIELDS.get(flag, ()) if key in model_config]
        if why is not None and (flag in flags or own):
            how = f"{flag} = true" if flag in flags else f"its key{'s' if len(own) > 1 else ''} {', '.join(own)}"
            raise NanotronConfigError(f"model.model_config is nanotron's {name} ({how}): {why}; nanoflow converts "
                                      "nanotron's LlamaConfig and Qwen2Config only, so it cannot be converted")


def _in_order(table: dict, cls) -> dict:
    """`table` in the order of `cls`'s fields, as nanoflow's docs list them; other keys last."""
    names = [f.name for f in attrs.fields(cls)]
    return {**{name: table[name] for name in names if name in table}, **table}


def _model_args(record: _Conversion, model: dict) -> dict:
    """The [model] keys that nanotron's ModelArgs gives beside model_config: its dtype and its init_method's std."""
    out: dict[str, str | float] = {}
    for key, value in model.items():
        if key == "model_config" or value is None:
            continue
        if key == "dtype":
            dtype = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}.get(
                str(value).removeprefix("torch."))
            if dtype is None:
                record.drop("model.dtype", value, "nanoflow trains in float32 or with bfloat16 autocast")
            else:
                out["dtype"] = dtype
        elif key == "init_method" and isinstance(value, dict) and "std" in value and _fits(value["std"], float) \
                and set(value) <= {"std", "scaling_method"}:
            out["initializer_range"] = float(value["std"])
            record.notes.append(f"model.init_method.std = {value['std']} → model.initializer_range "
                                "(the std nanotron draws the weights with)")
            # nanotron's default scaling is NUM_LAYERS: the row-parallel projections get a smaller std.
            record.drop("model.init_method.scaling_method", str(value.get("scaling_method") or "NUM_LAYERS").upper())
        else:
            record.drop(f"model.{key}", value)
    return out


def _rope_scaling(record: _Conversion, rope, interpolation) -> dict | None:
    """nanotron's rope_scaling (HF's dict) or Qwen2's rope_seq_len_interpolation_factor as [model.rope_scaling]."""
    where = "model.model_config.rope_scaling"
    if rope is None and interpolation is not None:
        if not _fits(interpolation, float):
            record.drop("model.model_config.rope_seq_len_interpolation_factor", interpolation, "expected a number")
            return None
        record.notes.append(f"model.model_config.rope_seq_len_interpolation_factor = {interpolation} → "
                            "[model.rope_scaling] rope_type = \"linear\" (nanotron divides the positions by it, as "
                            "HF's linear RoPE scaling does)")
        return {"rope_type": "linear", "factor": float(interpolation)}
    if interpolation is not None:
        record.drop("model.model_config.rope_seq_len_interpolation_factor", interpolation,
                    "rope_scaling is set too; nanoflow applies one RoPE scaling")
    if rope is None:
        return None
    if not isinstance(rope, dict):
        record.drop(where, rope, "expected a mapping with HF's rope_scaling keys")
        return None
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:   # HF's older name
        rope["rope_type"] = rope.pop("type")
    kind = rope.get("rope_type")
    if kind not in ROPE_KEYS:
        record.drop(where, rope, f"nanoflow implements rope_type {', '.join(map(repr, ROPE_KEYS))}")
        return None
    out = {"rope_type": kind}
    for key, value in rope.items():
        if key == "rope_type":
            continue
        if key not in ROPE_KEYS[kind]:
            record.drop(f"{where}.{key}", value, f'not a key rope_type = "{kind}" takes in nanoflow')
        elif key == "truncate":
            if _fits(value, bool):
                out[key] = value
            else:
                record.drop(f"{where}.{key}", value, "expected true or false")
        elif key == "original_max_position_embeddings" and _fits(value, int):
            out[key] = value
        elif key != "original_max_position_embeddings" and _fits(value, float):
            out[key] = float(value)
        else:
            record.drop(f"{where}.{key}", value, "expected a number")
    record.notes.append(f"{where} → [model.rope_scaling]: nanotron's training code does not read rope_scaling (it "
                        "trains with plain RoPE); nanoflow applies it, as transformers does for the exported model. "
                        "Delete [model.rope_scaling] to reproduce nanotron's numbers")
    return {key: out[key] for key in ("rope_type", *ROPE_KEYS[kind]) if key in out}


def _upper_tp_mode(parallelism):
    """nanotron accepts tp_mode in any case (TensorParallelLinearMode[x.upper()])."""
    if isinstance(parallelism, dict) and isinstance(parallelism.get("tp_mode"), str):
        return {**parallelism, "tp_mode": parallelism["tp_mode"].upper()}
    return parallelism


def _optimizer(record: _Conversion, optimizer, tokens) -> dict:
    if not isinstance(optimizer, dict):
        record.drop("optimizer", optimizer, "expected a mapping")
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
        record.notes.append(f"optimizer.{{{', '.join(legacy)}}} → optimizer.optimizer_factory")
    out = record.table(optimizer, schema.OptimizerArgs, "optimizer")
    if _unset(optimizer.get("optimizer_factory"), "torch_adam_is_fused"):
        factory = dict(out.get("optimizer_factory") or {})
        _fill(record, factory, "optimizer.optimizer_factory", "torch_adam_is_fused", False,
              "nanotron's default: torch picks AdamW's kernel; nanoflow's default is true, the fused one")
        out["optimizer_factory"] = _in_order(factory, schema.OptimizerFactoryArgs)
        out = _in_order(out, schema.OptimizerArgs)
    if _unset(optimizer, "clip_grad"):   # the trainer clips only `if clip_grad is not None`
        out["clip_grad"] = False
        record.notes.append("optimizer.clip_grad unset (null): nanotron does not clip; written as clip_grad = false "
                            "(nanoflow's default is 1.0)")
    decay = optimizer.get("weight_decay")
    if _fits(decay, float) and decay > 0 and not optimizer.get("weight_decay_exclude_named_params"):
        record.notes.append(f"optimizer.weight_decay = {decay}: nanotron decays every parameter, the norms' weights "
                            "too; nanoflow never decays 1-D parameters (the norms)")
    schedule = optimizer.get("learning_rate_scheduler")
    if isinstance(schedule, dict) and isinstance(out.get("learning_rate_scheduler"), dict):
        train_steps = tokens.get("train_steps") if isinstance(tokens, dict) else None
        _schedule_defaults(record, schedule, out["learning_rate_scheduler"], train_steps)
        out["learning_rate_scheduler"] = _in_order(out["learning_rate_scheduler"], schema.LRSchedulerArgs)
    return out


def _schedule_defaults(record: _Conversion, raw: dict, out: dict, train_steps) -> None:
    """LRSchedulerArgs.__post_init__ and Config.__post_init__ (config.py), as nanotron resolves them."""
    where = "optimizer.learning_rate_scheduler"
    if _unset(raw, "lr_warmup_steps"):
        out["lr_warmup_steps"] = 0
    if _unset(raw, "lr_warmup_style"):
        _fill(record, out, where, "lr_warmup_style", "linear", "nanotron refuses an unset lr_warmup_style: its check "
              "runs before its default, which is linear")
    if _unset(raw, "lr_decay_style"):
        _fill(record, out, where, "lr_decay_style", "linear", "nanotron's default; nanoflow's is cosine")
    if _unset(raw, "min_decay_lr") and "learning_rate" in out:
        _fill(record, out, where, "min_decay_lr", out["learning_rate"], "nanotron's default: = learning_rate, no decay")
    warmup = out.get("lr_warmup_steps")
    length = out.get("lr_decay_steps")
    if isinstance(length, int) and length <= 0:
        _no_length_decay(record, out, length, train_steps)
    if _unset(raw, "lr_decay_steps") and isinstance(train_steps, int) and isinstance(warmup, int):
        length = train_steps - warmup   # nanotron's Config sets this whatever lr_decay_starting_step is
        if length > 0:
            wsd = " even with lr_decay_starting_step set, so the decay need not end by the last step" \
                if raw.get("lr_decay_starting_step") is not None else ""
            _fill(record, out, where, "lr_decay_steps", length,
                  f"nanotron's default: train_steps - lr_warmup_steps{wsd}")


def _no_length_decay(record: _Conversion, out: dict, length: int, train_steps) -> None:
    """lr_decay_steps <= 0, as nanotron's dump of a run whose warmup outlasts it holds (Config derived train_steps -
    lr_warmup_steps): lr_scheduler_builder's lr_lambda then has no decay phase, so the LR drops from learning_rate to
    min_decay_lr at once, at index max(lr_warmup_steps + 1, lr_decay_starting_step). nanoflow's lr_decay_steps is
    positive: the same drop is a decay of one step ending there, and a drop after the last step is no decay at all."""
    where = "optimizer.learning_rate_scheduler"
    warmup = out.get("lr_warmup_steps", 0)
    if not isinstance(warmup, int) or (warmup == 0 and length == 0):   # nanotron then trains at learning_rate²
        del out["lr_decay_steps"]
        record.drop(f"{where}.lr_decay_steps", length, "nanoflow's lr_decay_steps is positive; nanotron jumps to "
                    "min_decay_lr at lr_decay_starting_step (and with lr_warmup_steps = 0 trains at learning_rate²)")
        return
    start = out.get("lr_decay_starting_step")
    drop = max(warmup + 1, start if isinstance(start, int) else 0)   # the first index at min_decay_lr
    if isinstance(train_steps, int) and drop > train_steps:
        del out["lr_decay_steps"]
        record.notes.append(f"{where}.lr_decay_steps = {length}: nanotron drops the LR to min_decay_lr at step {drop}, "
                            f"after train_steps = {train_steps}; left unset (nanoflow's derived decay is not reached "
                            "either)")
        return
    out["lr_decay_steps"] = 1
    if drop > warmup + 1:
        out["lr_decay_starting_step"] = drop - 1
    at = f" and lr_decay_starting_step = {drop - 1}" if drop > warmup + 1 else ""
    record.notes.append(f"{where}.lr_decay_steps = {length}: nanotron has no decay then, and drops the LR from "
                        f"learning_rate to min_decay_lr at once at step {drop}; written as lr_decay_steps = 1{at}, "
                        "the same drop")


def _stage(record: _Conversion, stage, index: int) -> dict:
    where = f"data_stages[{index}]"
    label = where + (f' (stage "{stage["name"]}")' if isinstance(stage, dict) and stage.get("name") else "")
    data = stage.get("data") if isinstance(stage, dict) else None
    if isinstance(data, dict):
        dataset = data.get("dataset")
        if isinstance(dataset, dict) and isinstance(dataset.get("dataset_folder"), dict):
            dataset = _folder_weights(record, dataset, f"{where}.data.dataset")
        if isinstance(dataset, dict) and "sft_dataloader" in dataset:
            dataset = _sft_columns(record, dataset, f"{label}.data.dataset")
        stage = {**stage, "data": {**data, "dataset": dataset}}
    out = record.table(stage, schema.DatasetStageArgs, where)
    if isinstance(data, dict):
        out_data = out.setdefault("data", {})
        if data.get("dataset") is None:
            record.notes.append(f"{label}.data.dataset is null: nanotron trains this stage on random tokens (its dummy "
                                "data generator); nanoflow has no dummy data: give the stage a dataset")
        if data.get("seed") is None:
            out_data["seed"] = NANOTRON_DATA_SEED
            out["data"] = _in_order(out_data, schema.DataArgs)
    return out


def _sft_columns(record: _Conversion, dataset: dict, where: str) -> dict:
    """A dataset with an sft_dataloader key is nanotron's SFTDatasetsArgs, whatever the key's value (dacite's strict
    union: PretrainDatasetsArgs has no such key), and run_train.py tokenizes it with sft_processing.process_sft:
    prompt + completion + eos from the columns "prompt" and "completion", the loss on the completion and eos only.
    That is nanoflow's SFT stage on those two columns."""
    dataset = dict(dataset)
    flag = dataset.pop("sft_dataloader")
    if dataset.get("text_column_name") is not None:
        record.drop(f"{where}.text_column_name", dataset.pop("text_column_name"),
                    'nanotron\'s SFT dataset has no text column: it reads "prompt" and "completion"')
    dataset.setdefault("prompt_column_name", "prompt")
    dataset.setdefault("completion_column_name", "completion")
    record.notes.append(f"{where}.sft_dataloader = {_show(flag)}: nanotron's SFT data (prompt + completion + "
                        "end-of-text, the loss on the completion), read from its columns \"prompt\" and "
                        "\"completion\" → nanoflow's SFT stage: prompt_column_name = \"prompt\", "
                        "completion_column_name = \"completion\"")
    return dataset


def _split_eval_sets(record: _Conversion, stages: list) -> list[dict]:
    """nanotron loads every split of a hf_dataset_splits list and trains on "train" (run_train.py:
    get_datasets(...)["train"]); nanoflow trains on "train" too, and scores each other listed split as an eval
    set of the stage (named after the split), at the stage's last step."""
    found = []
    for i, stage in enumerate(stages):
        dataset = stage.get("data", {}).get("dataset", {}) if isinstance(stage, dict) else {}
        splits = dataset.get("hf_dataset_splits")
        if not isinstance(splits, list) or "train" not in splits:
            continue
        for split in splits:
            if split != "train":
                found.append((i, stage, dataset, split))
    entries = []
    for i, stage, dataset, split in found:
        shared = sum(other == split for _, _, _, other in found) > 1
        name = f"{stage.get('name')}/{split}" if shared else split
        own = {key: value for key, value in dataset.items()
               if key not in ("held_out_samples", "dataset_weights_end")}
        entry = {"name": name, **({"sequence_length": stage["sequence_length"]} if "sequence_length" in stage else {}),
                 "dataset": {**own, "hf_dataset_splits": split}}
        entries.append(entry)
        record.notes.append(f"data_stages[{i}].data.dataset.hf_dataset_splits = {_show(dataset['hf_dataset_splits'])}: "
                            f'nanotron trains on "train" only, and so does nanoflow; split "{split}" → '
                            f'[[evaluation.datasets]] "{name}" (scored at the end of each stage)')
    return entries


def _folder_weights(record: _Conversion, dataset: dict, where: str) -> dict:
    """Older nanotron's `dataset_folder: {folder: weight}` is dataset_folder + dataset_weights."""
    folders = dataset["dataset_folder"]
    if dataset.get("dataset_weights") is not None:
        record.drop(f"{where}.dataset_weights", dataset["dataset_weights"],
                    "dataset_folder's mapping gives the weights")
    record.notes.append(f"{where}.dataset_folder: the {{folder: weight}} mapping → dataset_folder + dataset_weights")
    return {**{k: v for k, v in dataset.items() if k != "dataset_weights"},
            "dataset_folder": [str(k) for k in folders], "dataset_weights": list(folders.values())}


def _fit_positions(record: _Conversion, out: dict) -> None:
    """nanotron's RoPE grows past max_position_embeddings; nanoflow refuses a longer sequence: raise it."""
    model, tokens = out.get("model"), out.get("tokens", {})
    if not isinstance(model, dict) or not isinstance(model.get("max_position_embeddings"), int):
        return
    lengths = {"tokens.sequence_length": tokens.get("sequence_length")}
    for i, stage in enumerate(out.get("data_stages", [])):
        lengths[f'data_stages[{i}] (stage "{stage.get("name")}").sequence_length'] = stage.get("sequence_length")
    lengths = {k: v for k, v in lengths.items() if isinstance(v, int)}
    if not lengths or max(lengths.values()) <= model["max_position_embeddings"]:
        return
    where, longest = max(lengths.items(), key=lambda kv: kv[1])
    record.notes.append(f"model.max_position_embeddings raised from {model['max_position_embeddings']} to {longest} "
                        f"for {where}: nanotron trains past max_position_embeddings (its RoPE table grows), nanoflow "
                        "refuses to; plain, linear and llama3 RoPE do not depend on it")
    model["max_position_embeddings"] = longest


def _path_notes(record: _Conversion, out: dict) -> None:
    checkpoints, tokenizer = out.get("checkpoints", {}), out.get("tokenizer", {})
    paths = [checkpoints.get("checkpoints_path"), checkpoints.get("resume_checkpoint_path")]
    for i, stage in enumerate(out.get("data_stages", [])):
        dataset = stage.get("data", {}).get("dataset", {})
        for key in ("hf_data_files", "dataset_folder"):
            value = dataset.get(key)
            paths += value if isinstance(value, list) else [value]
        blend = dataset.get("hf_dataset_or_datasets")
        if isinstance(blend, dict) and ("hf_data_files" in dataset or set(blend) & set(schema.BUILDERS)):
            record.notes.append(f"data_stages[{i}].data.dataset: a {{name = weight}} table names each part's files in "
                                'its key (e.g. "sft/*.jsonl" = 1.0), without hf_data_files or a bare builder name '
                                "such as json: rewrite it so, or the config will not load")
    if any(isinstance(p, str) and not is_remote(p) and not p.startswith("/") for p in paths):
        record.notes.append("relative paths are carried verbatim: nanoflow reads them relative to the TOML file, "
                            "nanotron relative to the working directory")
    name = tokenizer.get("tokenizer_name_or_path")
    if isinstance(name, str) and name != "bytes" and not name.endswith(".json"):
        record.notes.append(f"tokenizer.tokenizer_name_or_path = {name!r}: nanoflow loads a local tokenizer.json "
                            '(or a folder holding one), not a Hub name; download it and point there, or use "bytes"')
