"""Checks of [model] against other descriptions of the same model: [model.rope_scaling] and the RoPE table of an HF
config.json, an HF init_from's config.json (which also completes [model]), and the [model] section a checkpoint's
weights were trained under."""

from __future__ import annotations

from typing import Any

import attrs

from nanoflow.config.families import (
    FAMILIES,
    FAMILY_KEYS,
    HEADS,
    OTHER_FAMILIES,
    WHOLE_WIDTH,
    complete,
    nope_from_interval,
    unset_required,
)
from nanoflow.config.rope import ROPE_KEYS, Rope, RopeScalingArgs, stage_ropes
from nanoflow.config.schema import ModelArgs

# RoPE: the RoPE table of an HF config.json against [model.rope_scaling], and the RoPE each stage of a recorded
# config trained with

# What transformers computes a yarn key left out (or null) as: the comparisons below compare what is computed.
YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1, "truncate": True}


def hf_rope(hf: dict, default_theta: float = 10000.0, max_position_embeddings: int | None = None
            ) -> tuple[str, dict, str]:
    """(the key of config.json's RoPE table, that table as transformers reads it, where its rope_theta came from).

    transformers < 5 writes `rope_scaling` and a top-level `rope_theta`; transformers 5 writes
    `rope_parameters` with rope_theta inside. A non-empty rope_scaling wins, and a rope_theta inside the
    table wins over the top-level one; `type` is the legacy name of rope_type; yarn's truncate = null is false.
    llama3's and yarn's original_max_position_embeddings is a top-level one where config.json has it
    (transformers' config then holds it as an attribute, which wins), else the table's, else
    max_position_embeddings (config.json's, else `max_position_embeddings` given: the family's default).
    """
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf[where]) if isinstance(hf.get(where), dict) else {}
    if "rope_theta" in rope:
        theta_where = f"{where}.rope_theta"
    elif "rope_theta" in hf:
        theta_where, rope["rope_theta"] = "rope_theta", hf["rope_theta"]
    else:
        theta_where, rope["rope_theta"] = "rope_theta (absent: transformers' default)", default_theta
    rope.setdefault("rope_type", rope.pop("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn"):
        if hf.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings",
                        hf.get("max_position_embeddings", max_position_embeddings or 2048))
    if rope["rope_type"] == "yarn" and "truncate" in rope and rope["truncate"] is None:
        rope["truncate"] = False   # transformers tests it for truth: null does not truncate, absent does
    return where, rope, theta_where


def _rope_mismatches(model: ModelArgs, hf: dict, source: str, max_position_embeddings: int
                     ) -> tuple[list[str], list[str], RopeScalingArgs | None]:
    """(mismatches with [model.rope_scaling], RoPE variants nanoflow does not implement, config.json's scaling as
    [model.rope_scaling] takes it) for config.json `hf`. What is compared is what each computes: a yarn key left
    out is transformers' default, yarn's factor and original_max_position_embeddings are resolved as Rope.of
    resolves them."""
    where, rope, _ = hf_rope(hf, max_position_embeddings=max_position_embeddings)
    kind = rope["rope_type"]
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    unsupported = [] if partial in (None, 1, 1.0) else \
        [f"partial_rotary_factor = {partial!r} (nanoflow rotates the whole head)"]
    if kind not in ROPE_KEYS:
        return [], unsupported + [f"{where}.rope_type = {kind!r} (nanoflow implements "
                                  + ", ".join(ROPE_KEYS) + ")"], None
    try:
        theirs = RopeScalingArgs(rope_type=kind, **{key: rope.get(key) for key in ROPE_KEYS[kind]})
    except (TypeError, ValueError) as e:   # attrs' validators name the field second
        name = getattr(e.args[1], "name", None) if len(e.args) > 1 else None
        shown = f"{where}.{name} = {rope.get(name)!r}" if name else f"{where} = {hf[where]!r}"
        return [f"{source}: {shown}: not a valid value"], unsupported, None
    ours = model.rope_scaling or RopeScalingArgs()
    if ours.rope_type != kind:
        wanted = ", ".join([f'rope_type = "{kind}"'] + [f"{k} = {_toml(v)}" for k, v in rope.items()
                                                       if k in ROPE_KEYS[kind] and v is not None])
        return [f"model.rope_scaling.rope_type = {ours.rope_type!r}"
                + (" (unset: plain RoPE)" if model.rope_scaling is None else "")
                + f", but {source} has {where}.rope_type = {kind!r}; "
                f"write model.rope_scaling = {{{wanted}}}"], unsupported, theirs
    computed = [Rope.of(1.0, table, max_position_embeddings).scaling or RopeScalingArgs() for table in (ours, theirs)]
    problems = []
    for key in ROPE_KEYS[kind]:
        mine, their = (YARN_DEFAULTS.get(key) if getattr(c, key) is None else getattr(c, key) for c in computed)
        if mine != their or isinstance(mine, bool) != isinstance(their, bool):
            given = getattr(ours, key)
            shown = repr(given) if given is not None else f"unset ({mine!r})"
            problems.append(f"model.rope_scaling.{key} = {shown}, but {source} has {where}.{key} = "
                            f"{rope.get(key)!r}" + (f" ({their!r})" if rope.get(key) is None else ""))
    return problems, unsupported, theirs


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def recorded_stage_ropes(saved: dict) -> dict[str, Rope]:
    """The RoPE each stage of a recorded config (as Config.to_dict writes it: a checkpoint's) trains with, by stage
    name; in a record from before stages had RoPE keys, every stage has [model]'s."""
    model = recorded_model(saved["model"])

    def table(raw: dict | None) -> RopeScalingArgs | None:
        return None if raw is None else RopeScalingArgs(**raw)

    stages = sorted(saved["data_stages"], key=lambda stage: stage["start_training_step"])
    ropes = stage_ropes(model["rope_theta"], table(model.get("rope_scaling")), model["max_position_embeddings"],
                        [(stage.get("rope_theta"), table(stage.get("rope_scaling"))) for stage in stages])
    return {stage["name"]: rope for stage, rope in zip(stages, ropes, strict=True)}


def trained_rope(metadata: dict) -> Rope:
    """The RoPE of the stage that trained a checkpoint's step (its metadata: the last stage begun; at step 0, the
    first stage's, which the model starts with)."""
    ropes = recorded_stage_ropes(metadata["config"])
    begun = metadata["training"]["stages"]
    return ropes[begun[-1]["name"]] if begun else next(iter(ropes.values()))


# ---------------------------------------------------------------------------------------------
# [model] keys under weights that exist, and [model] init_from = an HF model folder (its config.json is read by
# nanoflow.preflight, which reads the folder; this module reads no files of a model)

# Every [model] key, by what a change of it means to weights that already exist (a resume): "shape" keys decide
# the weights' shapes and "numbers" keys what they were trained to compute — a change of either is refused; a
# change of a "changes" key is deliberate (a new machine another autocast dtype, like another parallel layout) and
# warned of; "free" keys touch neither (a change is said). RoPE is a stage's (nanoflow.config.rope): a begun
# stage's may not change (nanoflow.checkpoint.resume_checks.check_rope), a context extension is a new stage. The middle entry:
# whether an HF init_from's config.json gives the key (model_from_hf).
MODEL_KEYS = {
    "model_type": ("shape", True, ""),
    "vocab_size": ("shape", True, ""),
    "hidden_size": ("shape", True, ""),
    "intermediate_size": ("shape", True, ""),
    "num_hidden_layers": ("shape", True, ""),
    "num_attention_heads": ("shape", True, ""),
    "num_key_value_heads": ("shape", True, ""),
    "head_dim": ("shape", True, ""),
    "attention_bias": ("shape", True, ""),
    "sliding_window": ("numbers", True, ""),
    "no_rope_layers": ("numbers", True, ""),
    "no_rope_layer_interval": ("free", True, "the layers without RoPE are no_rope_layers', which it only fills in"),
    "max_position_embeddings": ("free", True,
                                "it bounds the sequence length; RoPE's tables are computed for the positions used"),
    "rms_norm_eps": ("numbers", True, ""),
    "rope_theta": ("free", True, "the RoPE of the stages that set none; each begun stage's is checked with the stage"),
    "rope_scaling": ("free", True, "the RoPE of the stages that set none; each begun stage's is checked with the "
                     "stage"),
    "tie_word_embeddings": ("shape", True, ""),
    "initializer_range": ("free", True, "it draws the weights of a fresh start only"),
    "dtype": ("changes", False, "the steps from here compute in it; the weights and moments stay float32"),
    "compile": ("free", False, "the same computation, compiled or not"),
    "init_from": ("free", False, "it is read at step 0 only"),
}

# What a checkpoint written before nanoflow had a key was trained with, where that is not the key's default
# today: dtype was float32 until "auto" (which every checkpoint since records resolved)
TRAINED_BEFORE_THE_KEY = {"dtype": "float32"}


def recorded_model(model: dict) -> dict:
    """A [model] section as Config.to_dict writes it (a checkpoint's record), completed as a fresh start of its family
    would be: a checkpoint written before nanoflow had a key was trained with that key's default (or
    TRAINED_BEFORE_THE_KEY's, where the default changed since)."""
    fields = attrs.fields_dict(ModelArgs)
    known = {key: value for key, value in model.items() if key in fields}
    try:
        if "rope_scaling" in known:
            known["rope_scaling"] = RopeScalingArgs(**known["rope_scaling"])
        args = ModelArgs(**(TRAINED_BEFORE_THE_KEY | known))
        return model if unset_required(args) else _drop_none(attrs.asdict(complete(args)))
    except (TypeError, ValueError, ZeroDivisionError):   # not a section nanoflow wrote: compared as it is
        return model


def _drop_none(table: dict) -> dict:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None}


def model_changes(saved: dict, current: dict) -> dict[str, list[str]]:
    """How the [model] section `current` differs from `saved`, the one a checkpoint's weights were trained under
    (both as Config.to_dict writes them): one line per key that differs, by its MODEL_KEYS role ("shape",
    "numbers": refused; "changes": warned of; "free": said). Pure: no IO."""
    saved, current = recorded_model(saved), recorded_model(current)
    changes: dict[str, list[str]] = {"shape": [], "numbers": [], "changes": [], "free": []}
    for key, (role, _, why) in MODEL_KEYS.items():
        was, now = saved.get(key), current.get(key)
        if was == now and isinstance(was, bool) == isinstance(now, bool):
            continue
        changes[role].append(f"model.{key} = {now!r} (was {was!r}): {why}" if why else
                             f"model.{key} was {was!r}, the config now says {now!r}"
                             + (" (the weights were trained under it)" if role == "numbers" else ""))
    return changes


# The type each config.json value nanoflow reads must have (a number must also be positive).
_KINDS: dict[str, Any] = {"vocab_size": int, "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int,
          "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int, "max_position_embeddings": int,
          "rms_norm_eps": (int, float), "initializer_range": (int, float), "tie_word_embeddings": bool,
          "attention_bias": bool, "sliding_window": int, "no_rope_layers": list, "no_rope_layer_interval": int}


def _hf_value(hf: dict, key: str, family: str, read: dict):
    """(config.json's `key` as transformers reads it for `family`, where it came from); `read` holds the keys read
    before it (the defaults that are other keys' values)."""
    default = FAMILIES[family].hf_defaults.get(key)
    if default == HEADS:
        default = read["num_attention_heads"]
    elif default == WHOLE_WIDTH:
        default = read["hidden_size"] // read["num_attention_heads"]
    if hf.get(key) is not None:
        return hf[key], key
    if key in hf:   # null: where it means something else than the default
        if key == "num_key_value_heads":
            return read["num_attention_heads"], f"{key} (null: num_attention_heads)"
        if key == "sliding_window":
            return False, f"{key} (null: no window)"
        if key in ("attention_bias", "tie_word_embeddings"):
            return False, f"{key} (null: false)"
        return default, f"{key} (null: transformers' {family} default)"
    return default, f"{key} (absent: transformers' {family} default)"


# Complex (C901) as one pass over config.json's keys as transformers reads them: the few odd keys are its exceptions.
def model_from_hf(model: ModelArgs, hf: dict, source: str = "config.json") -> tuple[ModelArgs, list[str]]:  # noqa: C901
    """[model] completed from an HF config.json (as a dict) read as transformers reads it for its model_type: each
    architecture key [model] leaves unset is config.json's (absent: transformers' default for that family), each
    key [model] gives must be the same. Returns (the completed model, one line per key that differs and per setting
    that would change the numbers and that nanoflow does not reproduce, naming the family and the key); the
    model is complete only without problems."""
    family = hf.get("model_type", "llama")
    if family not in FAMILIES:
        what = OTHER_FAMILIES.get(family, "another architecture") if isinstance(family, str) else "not a name"
        return model, [f"{source}: model_type = {family!r} ({what}): not supported: nanoflow reads "
                       + ", ".join(FAMILIES) + " folders"]
    problems, unsupported = [], _unsupported(hf, family)
    read: dict = {"model_type": family}
    wheres = {"model_type": "model_type"}
    keys = [k for k, (_, from_hf, _) in MODEL_KEYS.items() if from_hf and k not in ("model_type", "rope_theta",
                                                                                     "rope_scaling")]
    for key in keys:
        if key in FAMILY_KEYS and key not in FAMILIES[family].own_keys:
            continue
        if key == "no_rope_layers" and hf.get(key) is None:
            continue   # filled in below, from the interval
        if key == "no_rope_layer_interval" and key in hf and hf[key] is None and hf.get("no_rope_layers") is None:
            return model, [f"{source}: no_rope_layer_interval = null: not a valid value without no_rope_layers "
                           "(transformers' smollm3 finds the layers without RoPE from it)"]
        if key == "head_dim" and key in hf and hf[key] is None and family not in ("llama", "mistral"):
            unsupported.append(f"head_dim = null (transformers' {family} model reads a number)")
            continue
        read[key], wheres[key] = _hf_value(hf, key, family, read)
        value, kind = read[key], _KINDS[key]
        number = kind is not bool and kind is not list
        if value is not False and (not isinstance(value, kind) or (number and (isinstance(value, bool) or value <= 0))):
            return model, [f"{source}: {wheres[key]} = {value!r}: not a valid value"]
    if family == "smollm3" and "no_rope_layers" not in read:
        read["no_rope_layers"] = nope_from_interval(read["num_hidden_layers"], read["no_rope_layer_interval"])
        wheres["no_rope_layers"] = f"no_rope_layers (absent: from no_rope_layer_interval = {read['no_rope_layer_interval']})"
    _, rope, theta_where = hf_rope(hf, FAMILIES[family].hf_defaults["rope_theta"])
    read["rope_theta"], wheres["rope_theta"] = rope["rope_theta"], theta_where
    for key, value in read.items():
        ours = getattr(model, key)
        if key == "initializer_range":   # it only draws the weights init_from replaces: [model]'s, when given
            continue
        if ours is not None and (value != ours or isinstance(value, bool) != isinstance(ours, bool)):
            shown = "null" if value is False and "null" in wheres[key] else repr(value)
            problems.append(f"model.{key} = {ours!r}, but {source} has {wheres[key]} = {shown}")
    rope_problems, rope_unsupported, theirs = _rope_mismatches(model, hf, source, read["max_position_embeddings"])
    unsupported += rope_unsupported
    if model.rope_scaling is not None or theirs is None:
        problems += rope_problems
    elif theirs.rope_type != "default":
        read["rope_scaling"] = theirs
    problems += [f"{source}: {u}: not supported (model_type = {family!r})" for u in unsupported]
    if problems:
        return model, problems
    try:
        return attrs.evolve(model, **{k: v for k, v in read.items() if getattr(model, k) is None}), []
    except (TypeError, ValueError) as e:
        return model, [f"{source}: {e}"]


def _unsupported(hf: dict, family: str) -> list[str]:
    """The settings of an HF config.json of `family` that would change the numbers and that nanoflow does not
    reproduce (what transformers' own model of that family reads: activation, dropout, biases it has a key for,
    sliding layers, quantization); RoPE's are _rope_mismatches'."""
    unsupported = []
    architectures = hf.get("architectures")
    causal_lm = FAMILIES[family].causal_lm
    if architectures and causal_lm not in architectures:
        unsupported.append(f"architectures = {architectures!r} (nanoflow reads {causal_lm} weights)")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):   # transformers maps both to SiLU
        unsupported.append(f"hidden_act = {hf['hidden_act']!r} (nanoflow's MLP uses silu)")
    if family in ("llama", "smollm3") and hf.get("mlp_bias"):
        unsupported.append("mlp_bias = true (nanoflow's MLP has no bias)")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        unsupported.append(f"attention_dropout = {hf['attention_dropout']!r} (nanoflow trains without attention "
                           "dropout; set it to 0.0 in config.json to train without it)")
    if family == "llama" and hf.get("pretraining_tp") not in (None, 1):
        unsupported.append(f"pretraining_tp = {hf['pretraining_tp']!r} (nanoflow computes each projection whole; "
                           "set it to 1 in config.json)")
    if family == "llama" and (hf.get("use_sliding_window") or
                              (hf.get("sliding_window") is not None and hf.get("use_sliding_window") is not False)):
        unsupported.append(f"sliding_window = {hf.get('sliding_window')!r} (nanoflow attends to every earlier position)")
    if family in ("qwen2", "qwen3", "smollm3") and hf.get("use_sliding_window"):
        unsupported.append(f"use_sliding_window = true (sliding_window = {hf.get('sliding_window')!r}: nanoflow "
                           "attends to every earlier position)")
    layer_types = hf.get("layer_types")
    if isinstance(layer_types, list) and set(map(str, layer_types)) - {"full_attention"}:
        unsupported.append(f"layer_types = {sorted(set(map(str, layer_types)))!r} (nanoflow's layers all use full "
                           "attention)")
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and any(isinstance(value, dict) for value in rope.values()):
        unsupported.append("rope_parameters by layer type (nanoflow applies one RoPE to every layer)")
    if hf.get("quantization_config"):
        unsupported.append("quantization_config (nanoflow trains unquantized weights)")
    return unsupported
