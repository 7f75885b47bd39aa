"""The model families: what each of transformers' model_types nanoflow trains is, as data.

Every family is a Llama decoder with a few switches (the `Architecture` nanoflow.model builds from):

    llama    the base: pre-norm, SwiGLU, RoPE in every layer; `attention_bias` on q, k, v and o
    qwen2    biases on q, k and v always (no key; o_proj has none)
    qwen3    an RMSNorm over head_dim on each query and key head, before RoPE; head_dim stated;
             `attention_bias` on q, k, v and o
    mistral  head_dim stated; a `sliding_window` (nanoflow attends to every earlier position, so only a window
             no shorter than every sequence is reproduced)
    smollm3  the layers `no_rope_layers` marks 0 (else every `no_rope_layer_interval`-th) take no RoPE;
             `attention_bias` on q, k, v and o
    olmo2    each block's output is RMS-normed before it joins the residual stream (not its input); an
             RMSNorm over the whole q and k projections, before they are split into heads;
             `attention_bias` on q, k, v and o

A [model] section is completed here for a fresh start (nanoflow's defaults, whatever the family); an HF
config.json is read with transformers' own defaults for its family (nanoflow.config.model_checks), and
`hf_config` writes config.json back as transformers writes that family. Pure: no torch, no IO.
"""

from __future__ import annotations

import attrs
from attrs import frozen

HEADS = "num_attention_heads"                  # a default that is the number of query heads
WHOLE_WIDTH = "hidden_size / num_attention_heads"   # head_dim's default in every family but qwen3


@frozen
class Family:
    """One model_type: its causal-LM class, the [model] keys only some families have, and transformers' defaults
    (its config class's field defaults, transformers 5.25) for what an absent config.json key means."""

    causal_lm: str
    own_keys: tuple[str, ...]
    hf_defaults: dict


_COMMON = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": HEADS, "head_dim": WHOLE_WIDTH,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "initializer_range": 0.02}
_QWEN = {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
         "max_position_embeddings": 32768}

FAMILIES = {
    "llama": Family("LlamaForCausalLM", ("attention_bias",), {**_COMMON, "attention_bias": False}),
    "qwen2": Family("Qwen2ForCausalLM", (), _QWEN),
    "qwen3": Family("Qwen3ForCausalLM", ("attention_bias",), {**_QWEN, "head_dim": 128, "attention_bias": False}),
    "mistral": Family("MistralForCausalLM", ("sliding_window",),
                      {**_COMMON, "intermediate_size": 14336, "num_key_value_heads": 8,
                       "max_position_embeddings": 131072, "sliding_window": 4096}),
    "smollm3": Family("SmolLM3ForCausalLM", ("attention_bias", "no_rope_layers", "no_rope_layer_interval"),
                      {**_COMMON, "vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 36,
                       "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                       "rope_theta": 2000000.0, "tie_word_embeddings": True, "attention_bias": False,
                       "no_rope_layer_interval": 4}),
    "olmo2": Family("Olmo2ForCausalLM", ("attention_bias",),
                    {**_COMMON, "vocab_size": 50304, "rms_norm_eps": 1e-5, "attention_bias": False}),
}
FAMILY_KEYS = ("attention_bias", "sliding_window", "no_rope_layers", "no_rope_layer_interval")   # some families'

# What another model_type's folder is, for the message that refuses it.
OTHER_FAMILIES = {
    "mixtral": "a mixture of experts", "qwen2_moe": "a mixture of experts", "qwen3_moe": "a mixture of experts",
    "olmoe": "a mixture of experts", "deepseek_v3": "a mixture of experts", "gemma2": "logit soft-capping",
    "gemma3_text": "logit soft-capping and sliding layers", "gemma3": "a vision model",
}

# The sizes a fresh start must state (with an HF init_from, config.json states them).
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
DEFAULT_FAMILY = "llama"
# nanoflow's defaults for a fresh start, whatever the family (the sliding window: none); num_key_value_heads
# and head_dim follow from the heads and hidden_size (complete)
FRESH_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                  "tie_word_embeddings": False, "initializer_range": 0.02, "attention_bias": False,
                  "sliding_window": False, "no_rope_layer_interval": 4}


def nope_from_interval(layers: int, interval: int) -> list[int]:
    """SmolLM3's rule without a no_rope_layers list: layer i uses RoPE (1) unless i + 1 is a multiple of `interval`."""
    return [int((i + 1) % interval != 0) for i in range(layers)]


# ---------------------------------------------------------------------------------------------
# The switches

@frozen
class Architecture:
    """What nanoflow.model builds differently per family: a few switches, nothing else."""

    head_dim: int
    qkv_bias: bool = False           # biases on q_proj, k_proj, v_proj
    o_bias: bool = False             # a bias on o_proj
    qk_norm: str | None = None       # an RMSNorm on queries and keys before RoPE: over each "head" (qwen3), over the
                                     # whole "projection" (olmo2)
    norm_after: bool = False         # each block's output is normed, not its input (olmo2)
    nope_layers: tuple[int, ...] = ()   # the layers that apply no RoPE (smollm3)


def architecture(model) -> Architecture:
    """The switches of a complete [model] (ModelArgs)."""
    family = model.model_type
    bias = bool(model.attention_bias)
    rope = model.no_rope_layers or ()
    return Architecture(
        head_dim=model.head_dim,
        qkv_bias=family == "qwen2" or bias,
        o_bias=bias,                     # qwen2 has no key: its o_proj never has a bias
        qk_norm={"qwen3": "head", "olmo2": "projection"}.get(family),
        norm_after=family == "olmo2",
        nope_layers=tuple(i for i in range(model.num_hidden_layers) if not rope[i]) if family == "smollm3" else ())


# ---------------------------------------------------------------------------------------------
# Completing and checking a [model] section

def unset_required(model) -> list[str]:
    """The sizes a fresh start must give and [model] does not."""
    return [key for key in REQUIRED if getattr(model, key) is None]


def fresh_problems(model) -> list[str]:
    """Why `model` (ModelArgs) cannot be completed with nanoflow's defaults: an unset size, or heads that do not
    divide hidden_size when head_dim is unset."""
    problems = [f"model.{key}: required key missing: add {key} = 1 under [model] (or name an HF model folder in "
                "model.init_from: its config.json gives it)" for key in unset_required(model)]
    if not problems and model.head_dim is None and model.hidden_size % model.num_attention_heads:
        problems.append(f"model.hidden_size = {model.hidden_size} is not divisible by model.num_attention_heads = "
                        f"{model.num_attention_heads} (or state model.head_dim)")
    return problems


def complete(model):
    """`model` (ModelArgs) with every unset key given nanoflow's default for a fresh model of its family, the
    values derived from others (num_key_value_heads, head_dim, smollm3's no_rope_layers) included; its sizes
    must be set (unset_required)."""
    family = model.model_type or DEFAULT_FAMILY
    filled = {"model_type": family}
    for key, value in FRESH_DEFAULTS.items():
        if getattr(model, key) is None and (key not in FAMILY_KEYS or key in FAMILIES[family].own_keys):
            filled[key] = value
    if model.num_key_value_heads is None:
        filled["num_key_value_heads"] = model.num_attention_heads
    if model.head_dim is None:
        filled["head_dim"] = model.hidden_size // model.num_attention_heads
    if family == "smollm3" and model.no_rope_layers is None:
        interval = model.no_rope_layer_interval or FRESH_DEFAULTS["no_rope_layer_interval"]
        filled["no_rope_layers"] = nope_from_interval(model.num_hidden_layers, interval)
    return attrs.evolve(model, **filled)


def family_problems(model, tp: int = 1) -> list[str]:
    """What a complete [model] asks of its family that the family does not have or cannot be (on `tp` ranks)."""
    family = model.model_type
    problems = [f"model.{key} = {_toml(getattr(model, key))}: model_type = \"{family}\" has no {key} "
                f"({_who_has(key)})"
                for key in FAMILY_KEYS if getattr(model, key) is not None and key not in FAMILIES[family].own_keys]
    if family == "olmo2" and tp > 1:
        problems.append(f"parallelism.tp = {tp}: olmo2's q/k norms span the whole projection, which tensor "
                        "parallelism splits over ranks; nanoflow trains olmo2 on tp = 1 (dp shards it)")
    if family == "llama" and model.hidden_size % model.num_attention_heads:
        # transformers' LlamaConfig refuses it even with head_dim stated
        problems.append(f"model.hidden_size = {model.hidden_size} is not divisible by model.num_attention_heads = "
                        f"{model.num_attention_heads} (transformers' LlamaConfig requires it)")
    rope = model.no_rope_layers
    if family == "smollm3" and rope is not None:
        if len(rope) < model.num_hidden_layers:
            problems.append(f"model.no_rope_layers has {len(rope)} entries, one per layer is needed "
                            f"(num_hidden_layers = {model.num_hidden_layers})")
        if set(rope) - {0, 1}:
            problems.append(f"model.no_rope_layers = {rope}: each entry is 1 (the layer applies RoPE) or 0 (NoPE)")
    return problems


def _who_has(key: str) -> str:
    return "only " + ", ".join(name for name, f in FAMILIES.items() if key in f.own_keys) + " have it" \
        if sum(key in f.own_keys for f in FAMILIES.values()) > 1 else \
        "only " + next(name for name, f in FAMILIES.items() if key in f.own_keys) + " has it"


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


# ---------------------------------------------------------------------------------------------
# config.json as transformers writes each family

def hf_config(model: dict, *, dtype: str = "float32", bos_token_id: int | None = None,
              eos_token_id: int | None = None) -> dict:
    """config.json for the complete [model] section `model` (a dict, as Config.to_dict writes it): the keys the
    family's config class writes (transformers 5: rope_parameters), with rope_theta and rope_scaling also at the
    top level and torch_dtype beside dtype for transformers 4."""
    family = model.get("model_type", "llama")
    layers, heads = model["num_hidden_layers"], model["num_attention_heads"]
    head_dim = model.get("head_dim", model["hidden_size"] // heads)
    rope_theta = float(model.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in (model.get("rope_scaling") or {"rope_type": "default"}).items() if v is not None}
    config = {
        "architectures": [FAMILIES[family].causal_lm],
        "model_type": family,
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": model.get("num_key_value_heads", heads),
        "hidden_act": "silu",
        "max_position_embeddings": model.get("max_position_embeddings", 2048),
        "rms_norm_eps": model.get("rms_norm_eps", 1e-5),
        "rope_parameters": {**scaling, "rope_theta": rope_theta},
        "rope_theta": rope_theta,
        "rope_scaling": scaling if scaling["rope_type"] != "default" else None,
        "tie_word_embeddings": bool(model.get("tie_word_embeddings", False)),
        "initializer_range": model.get("initializer_range", 0.02),
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }
    if family in ("llama", "qwen3", "mistral") or head_dim != model["hidden_size"] // heads:
        config["head_dim"] = head_dim   # the others' config classes have no head_dim, but their models read one
    if family in ("llama", "qwen3", "smollm3", "olmo2"):
        config["attention_bias"] = bool(model.get("attention_bias", False))
    if family in ("llama", "smollm3"):
        config["mlp_bias"] = False
    if family == "llama":
        config["pretraining_tp"] = 1
    if family in ("qwen2", "qwen3", "smollm3"):   # sliding layers: none
        config.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * layers)
    if family in ("qwen2", "qwen3"):
        config["max_window_layers"] = 28   # the config class's default: without sliding layers it says nothing
    if family == "mistral":
        window = model.get("sliding_window", False)
        config["sliding_window"] = None if window is False else window
    if family == "smollm3":
        config["no_rope_layers"] = list(model["no_rope_layers"])
        config["no_rope_layer_interval"] = model.get("no_rope_layer_interval", 4)
    return config
