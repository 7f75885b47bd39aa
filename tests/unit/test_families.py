"""The model families against transformers' own models: a random tiny model of each family built with transformers'
config class is read by `[model] init_from` with its logits at every position (float32, 1e-5); config.json keys
left out are read as transformers reads them; what nanoflow does not reproduce is refused by name, with the family
and the key (exports of trained runs: tests/e2e/test_families_runs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import tiny
from support.families import CLASSES, FRESH, IDS, SHAPES, SIZES, logits

import nanoflow
import nanoflow.loss
from nanoflow import ConfigError
from nanoflow.config import FAMILIES, config_from_dict, model_changes, recorded_model
from nanoflow.config.families import HEADS, WHOLE_WIDTH
from nanoflow.model import Llama
from nanoflow.run import open_run


def hf_model(family: str, seed: int = 0, **keys) -> transformers.PreTrainedModel:
    """A random transformers model of `family`, float32, its norms and biases drawn too (transformers starts them at
    1 and 0, where a wrong placement would go unseen)."""
    config = CLASSES[family](**{**SIZES, **keys})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_()
    return model


def init_from_config(tmp_path: Path, folder: Path, *overrides: str, model: dict | None = None):
    """tiny.toml whose [model] is only `init_from = folder` (and `model`), completed as bin/train completes it."""
    raw = tiny(tmp_path / "run").to_dict()
    raw["model"] = {**(model or {}), "init_from": str(folder)}
    return open_run(config_from_dict(raw, "test.toml", list(overrides)), join=False).config


@pytest.mark.parametrize("shape", SHAPES)
def test_an_hf_folder_of_each_family_starts_a_run_with_transformers_logits(tmp_path, shape):
    family, keys = SHAPES[shape]
    source = hf_model(family, **keys)
    source.save_pretrained(tmp_path / "hf")
    config = init_from_config(tmp_path, tmp_path / "hf")
    assert config.model.model_type == family
    assert config.model.head_dim == (getattr(source.config, "head_dim", None) or 64 // 8)
    state = nanoflow.init_state(config)
    theirs, ours = logits(source, IDS), logits(state.model, IDS)
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert set(dict(state.model.named_parameters())) <= set(source.state_dict())


# What an absent config.json key means, per family: the model built with the config class's defaults for these
# keys, then the keys deleted from config.json (as older or hand-written folders have it).
ABSENT = {
    "llama": ("num_key_value_heads", "head_dim", "attention_bias", "rms_norm_eps", "rope_parameters"),
    "qwen2": ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "rms_norm_eps",
              "num_key_value_heads", "max_position_embeddings"),
    "qwen3": ("head_dim", "attention_bias", "rms_norm_eps", "tie_word_embeddings"),
    "mistral": ("num_key_value_heads", "head_dim", "sliding_window", "rms_norm_eps"),
    "smollm3": ("no_rope_layers", "no_rope_layer_interval", "rope_parameters", "tie_word_embeddings",
                "attention_bias", "num_key_value_heads"),
    "olmo2": ("num_key_value_heads", "rms_norm_eps", "attention_bias", "max_position_embeddings"),
}


@pytest.mark.parametrize("family", ABSENT)
def test_absent_config_json_keys_are_read_as_transformers_reads_them(tmp_path, family):
    sizes = {"num_attention_heads": 32} if family in ("qwen2", "smollm3") else {}   # kv heads' defaults: 32, 4
    built = {k: v for k, v in {**SIZES, **sizes}.items() if k not in ABSENT[family]}
    config = CLASSES[family](**built)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    written = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in written.items() if k not in ABSENT[family]}))
    source = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model = init_from_config(tmp_path, tmp_path / "hf").model
    theirs = source.config
    assert model.num_key_value_heads == theirs.num_key_value_heads
    assert model.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    assert model.rms_norm_eps == theirs.rms_norm_eps and model.tie_word_embeddings == theirs.tie_word_embeddings
    assert model.rope_theta == theirs.rope_parameters["rope_theta"]
    assert model.max_position_embeddings == theirs.max_position_embeddings
    if family == "mistral":
        assert model.sliding_window == theirs.sliding_window == 4096
    if family == "smollm3":
        assert model.no_rope_layers == theirs.no_rope_layers == [1, 1, 1, 0]
    assert (logits(nanoflow.init_state(model_config(tmp_path, model)).model, IDS) - logits(source, IDS)).abs().max() \
        <= 1e-5


def model_config(tmp_path: Path, model):
    """tiny.toml with the complete [model] `model` (its init_from kept: the weights)."""
    import attrs

    raw = tiny(tmp_path / "run").to_dict()
    raw["model"] = {k: v for k, v in attrs.asdict(model).items() if v is not None}
    return config_from_dict(raw, "test.toml")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_defaults_table_is_transformers_own(family):
    config = CLASSES[family]()
    for key, default in FAMILIES[family].hf_defaults.items():
        if default == HEADS:
            default = config.num_attention_heads
        elif default == WHOLE_WIDTH:
            assert getattr(config, "head_dim", None) in (None, config.hidden_size // config.num_attention_heads)
            continue
        theirs = config.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(config, key)
        assert theirs == default, key


# ---------------------------------------------------------------------------------------------
# Refused by name, with the family and the key

def test_a_sliding_window_shorter_than_a_sequence_is_refused_naming_the_stage(tmp_path):
    hf_model("mistral", sliding_window=16).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError) as error:
        init_from_config(tmp_path, tmp_path / "hf")
    assert 'data_stages[1] (stage "sft"): sequence_length = 24 is longer than model.sliding_window = 16 (mistral)' \
        in str(error.value) and "tokens: sequence_length = 32 is longer" in str(error.value)
    assert init_from_config(tmp_path, tmp_path / "hf", "tokens.sequence_length=16",
                            "data_stages.sft.sequence_length=16").model.sliding_window == 16


@pytest.mark.parametrize("family, change, message", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4096},
     "use_sliding_window = true (sliding_window = 4096: nanoflow attends to every earlier position): not supported "
     "(model_type = 'qwen2')"),
    ("smollm3", {"use_sliding_window": True, "sliding_window": 4096}, "(model_type = 'smollm3')"),
    ("smollm3", {"mlp_bias": True}, "mlp_bias = true (nanoflow's MLP has no bias): not supported (model_type = "
                                    "'smollm3')"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act = 'gelu' (nanoflow's MLP uses silu): not supported (model_type = "
                                      "'qwen3')"),
    ("mistral", {"layer_types": ["sliding_attention"] * 4}, "layer_types = ['sliding_attention']"),
    ("qwen3", {"head_dim": None}, "head_dim = null (transformers' qwen3 model reads a number)"),
    ("qwen2", {"architectures": ["Qwen2ForSequenceClassification"]}, "(nanoflow reads Qwen2ForCausalLM weights)"),
    ("qwen2", {"model_type": "qwen2_moe"}, "model_type = 'qwen2_moe' (a mixture of experts): not supported"),
])
def test_what_a_family_cannot_be_reproduced_in_is_refused_by_name(tmp_path, family, change, message):
    hf_model(family).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ConfigError, match="model.init_from: .*config.json: ") as error:
        init_from_config(tmp_path, tmp_path / "hf")
    assert message in str(error.value)


def test_a_key_given_in_model_must_agree_with_config_json(tmp_path):
    hf_model("qwen3", head_dim=16).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError) as error:
        init_from_config(tmp_path, tmp_path / "hf", model={"head_dim": 8, "model_type": "qwen2", "vocab_size": 288})
    message = str(error.value)
    assert "model.init_from: model.model_type = 'qwen2', but" in message and "has model_type = 'qwen3'" in message
    assert "model.head_dim = 8, but" in message and "config.json has head_dim = 16" in message
    assert "vocab_size" not in message
    config = init_from_config(tmp_path, tmp_path / "hf", model={"head_dim": 16, "dtype": "bfloat16"})
    assert config.model.head_dim == 16 and config.model.dtype == "bfloat16"


@pytest.mark.parametrize("sets, message", [
    (['model.model_type="qwen2"', "model.attention_bias=true"],
     'model.attention_bias = true: model_type = "qwen2" has no attention_bias (only llama, qwen3, smollm3, olmo2 have it)'),
    (["model.no_rope_layers=[1, 0]"], 'model.no_rope_layers = [1, 0]: model_type = "llama" has no no_rope_layers '
                                      "(only smollm3 has it)"),
    (['model.model_type="smollm3"', "model.no_rope_layers=[1, 0, 1]"], "model.no_rope_layers has 3 entries, one per "
                                                                      "layer is needed (num_hidden_layers = 4)"),
    (['model.model_type="smollm3"', "model.no_rope_layers=[1, 2, 1, 1]"], "each entry is 1"),
    (['model.model_type="mistral"', "model.sliding_window=16"], "sequence_length = 32 is longer than "
                                                               "model.sliding_window = 16 (mistral)"),
    (['model.model_type="qwen3"', "model.hidden_size=30"], "model.hidden_size = 30 is not divisible by "
                                                          "model.num_attention_heads = 4 (or state model.head_dim)"),
    (['model.model_type="gemma2"'], "model.model_type"),
    (['model.model_type="olmo2"', "parallelism.tp=2"], "parallelism.tp = 2: olmo2's q/k norms span the whole "
                                                        "projection, which tensor parallelism splits over ranks"),
])
def test_a_fresh_model_of_a_family_is_checked_when_loaded(tmp_path, sets, message):
    with pytest.raises(ConfigError) as error:
        tiny(tmp_path / "run", "model.num_hidden_layers=4", *sets)
    assert message in str(error.value), str(error.value)


def test_a_fresh_model_needs_its_sizes_unless_an_hf_folder_gives_them(tmp_path):
    raw = tiny(tmp_path / "run").to_dict()
    raw["model"] = {"model_type": "qwen3", "hidden_size": 64}
    with pytest.raises(ConfigError) as error:
        config_from_dict(raw, "test.toml")
    assert "model.vocab_size: required key missing: add vocab_size = 1 under [model] (or name an HF model folder " \
        "in model.init_from: its config.json gives it)" in str(error.value)
    assert "hidden_size:" not in str(error.value)
    qwen3 = config_from_dict(raw, "test.toml", ["model.vocab_size=288", "model.intermediate_size=64",
                                                "model.num_hidden_layers=2", "model.num_attention_heads=4"]).model
    assert (qwen3.head_dim, qwen3.num_key_value_heads, qwen3.attention_bias, qwen3.rms_norm_eps) == (16, 4, False, 1e-5)
    assert (qwen3.architecture.qk_norm, qwen3.architecture.qkv_bias, qwen3.sliding_window) == ("head", False, None)


def test_an_hf_folder_gives_the_keys_a_model_with_its_type_and_sizes_leaves_unset(tmp_path):
    """model_type and every required size beside init_from, num_key_value_heads and max_position_embeddings unset:
    the config loads (it raised a TypeError, dividing by the unset heads) and config.json completes it."""
    hf_model("qwen2").save_pretrained(tmp_path / "hf")
    given = {"model_type": "qwen2", **{k: SIZES[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                             "num_hidden_layers", "num_attention_heads")}}
    raw = tiny(tmp_path / "run").to_dict()
    raw["model"] = {**given, "init_from": str(tmp_path / "hf")}
    assert config_from_dict(raw, "test.toml").model.num_key_value_heads is None
    model = init_from_config(tmp_path, tmp_path / "hf", model=given).model
    assert (model.num_key_value_heads, model.max_position_embeddings) == (2, 64)


def test_smollm3_s_no_rope_layers_come_from_the_interval_and_the_list_wins(tmp_path):
    base = ['model.model_type="smollm3"', "model.num_hidden_layers=8"]
    assert tiny(tmp_path, *base).model.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    assert tiny(tmp_path, *base, "model.no_rope_layer_interval=2").model.architecture.nope_layers == (1, 3, 5, 7)
    listed = tiny(tmp_path, *base, "model.no_rope_layer_interval=2", "model.no_rope_layers=[0, 1, 1, 1, 1, 1, 1, 1]")
    assert listed.model.architecture.nope_layers == (0,)


def test_a_record_from_before_the_families_reads_as_the_llama_it_trained(tmp_path):
    current = tiny(tmp_path / "run").to_dict()["model"]
    older = {k: v for k, v in current.items() if k not in ("model_type", "head_dim", "attention_bias")}
    assert recorded_model(older) == current
    assert model_changes(older, current) == {"shape": [], "numbers": [], "changes": [], "free": []}
    assert model_changes(older, {**current, "head_dim": 16})["shape"] == [
        "model.head_dim was 8, the config now says 16"]


def test_qwen_s_vocabulary_through_the_fused_loss(monkeypatch):
    """Qwen's 151,936 rows: the fused loss (several chunks of positions, the last one short) equals the plain one."""
    config = tiny("unused", 'model.model_type="qwen3"', "model.vocab_size=151936", "model.hidden_size=16",
                  "model.intermediate_size=32", "model.num_hidden_layers=1", "model.head_dim=8").model
    model = Llama(config)
    model.reset_parameters(torch.Generator().manual_seed(0))
    ids = torch.randint(0, 151936, (3, 40), generator=torch.Generator().manual_seed(2))
    labels = ids.roll(-1, dims=1)
    labels[0, :7] = -100
    monkeypatch.setattr(nanoflow.loss, "CPU_CHUNK_BYTES", 4 * 151936 * 50)   # 50 positions a chunk: 3 chunks of 120
    results, count = [], (labels != -100).sum()
    for method in ("plain", "fused"):
        model.zero_grad()
        model.loss_method = method
        loss = model(ids, labels, grad_scale=torch.ones(()) / count) / count
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=0, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------
# The switches compose with the rest: recompute, bf16, compile (the layouts: tests/e2e/test_families_process.py)


def one_step(config, batch):
    state, metrics = nanoflow.train_step(nanoflow.init_state(config), batch)
    return metrics["loss"], metrics["grad_norm"], dict(state.model.named_parameters())


@pytest.mark.parametrize("family", FRESH)
def test_recompute_and_bfloat16_compose_with_the_family_switches(tmp_path, family):
    from helpers import assert_same_steps
    from test_step import random_batch

    batch = random_batch(4, 32, seed=1, masked=True)
    plain = one_step(tiny(tmp_path / "run", *FRESH[family]), batch)
    assert_same_steps([plain, one_step(tiny(tmp_path / "run", *FRESH[family], "parallelism.recompute_layer=true"),
                                       batch)])
    loss, _, params = one_step(tiny(tmp_path / "run", *FRESH[family], 'model.dtype="bfloat16"'), batch)
    assert loss == pytest.approx(plain[0], abs=0.05) and all(p.dtype == torch.float32 for p in params.values())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "smollm3", "olmo2"])
def test_compile_composes_with_the_family_switches(tmp_path, family):
    from nanoflow.build import build_model

    ids = torch.randint(0, 288, (2, 32), generator=torch.Generator().manual_seed(0))
    grads = []
    for compiled in (False, True):
        model = build_model(tiny(tmp_path / "run", *FRESH[family], f"model.compile={str(compiled).lower()}"))
        model(ids, ids.roll(-1, 1)).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        scale = grad.abs().max().item()   # a summed loss: gradients up to 1e3; compiled kernels sum in another order
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("family", [*FRESH, "llama-biases"])
def test_the_size_check_counts_every_parameter_of_each_family(tmp_path, family):
    from nanoflow.preflight import parameter_count

    sets = FRESH.get(family, ["model.attention_bias=true", "model.head_dim=16"])
    for tied in ("true", "false"):
        model = tiny(tmp_path, *sets, f"model.tie_word_embeddings={tied}").model
        assert parameter_count(model) == sum(p.numel() for p in Llama(model).parameters())


@pytest.mark.parametrize("change", [{"num_attention_heads": 0}, {"hidden_size": "64"}, {"head_dim": True},
                                    {"no_rope_layer_interval": None}, {"rms_norm_eps": -1e-6}])
def test_a_config_json_value_that_is_not_a_size_is_named(tmp_path, change):
    hf_model("smollm3").save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    written = {k: v for k, v in json.loads(path.read_text()).items() if k != "no_rope_layers"}
    path.write_text(json.dumps({**written, **change}))
    key = next(iter(change))
    with pytest.raises(ConfigError, match=rf"model.init_from: .*config.json: {key}.* = .*: not a valid value"):
        init_from_config(tmp_path, tmp_path / "hf")
