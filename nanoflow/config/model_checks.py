"""Checks of [model] against other descriptions of the same model: [model.rope_scaling] and the RoPE table of an HF
config.json, an HF init_from's config.json, and the [model] section a checkpoint's weights were trained under."""

from __future__ import annotations

import difflib

import attrs

from nanoflow.config.schema import ModelArgs, RopeScalingArgs

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
# What a checkpoint written before nanoflow had a key was trained with, where that is not the key's default
# today: dtype was float32 until "auto" (which every checkpoint since records resolved)
TRAINED_BEFORE_THE_KEY = {"dtype": "float32"}


def _recorded(model: dict, key: str):
    """model[key] of a [model] section as Config.to_dict writes it (None dropped); absent: what a checkpoint
    written before nanoflow had the key was trained with (the key's default, or TRAINED_BEFORE_THE_KEY's)."""
    if key in model:
        return model[key]
    if key in TRAINED_BEFORE_THE_KEY:
        return TRAINED_BEFORE_THE_KEY[key]
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
