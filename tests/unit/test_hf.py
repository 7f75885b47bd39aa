"""HF interop: HF folders (sharded or not) import exactly, and a [model] section that disagrees with config.json
is refused (export of trained runs, and `[model] init_from = <HF folder>` training: tests/e2e/test_hf_runs.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import TINY
from process_helpers import run_in_process, train_args
from support.hf import LLAMA3, SCALED_MODEL, checked, hf_folder, scaled_hf_folder, tiny, toml_table

import nanoflow
from nanoflow import ConfigError
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.interop.export import export_hf
from nanoflow.io import read_hf
from nanoflow.io.hf import HFFormatError, HFWeights, is_hf_folder

# ---------------------------------------------------------------------------------------------
# Import


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_import_then_export_is_an_identity(tmp_path, shard):
    expected = hf_folder(tmp_path / "hf_in", tied=True, shard=shard)
    assert (tmp_path / "hf_in" / "model.safetensors.index.json").exists() == (shard is not None)
    assert is_hf_folder(str(tmp_path / "hf_in"))
    config, tensors = read_hf(str(tmp_path / "hf_in"))
    assert config["model_type"] == "llama"
    assert set(tensors) == set(expected) - {"lm_head.weight"}   # a tied head is stored once
    for name, t in tensors.items():
        assert torch.equal(t, expected[name]), name

    config = checked(tmp_path, f"model.init_from={json.dumps(str(tmp_path / 'hf_in'))}")
    state = nanoflow.init_state(config)   # step 0: the HF weights, untouched
    Checkpointer(config).save(state)
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf_out"), max_shard_size=20_000 if shard else 5 * 10**9)
    _, exported = read_hf(str(tmp_path / "hf_out"))
    assert set(exported) == set(tensors)
    for name, t in exported.items():
        assert t.dtype == expected[name].dtype and torch.equal(t, expected[name]), name


def test_init_from_hf_folder_with_another_model_names_every_mismatch(tmp_path):
    hf_folder(tmp_path / "hf", tied=False)
    with pytest.raises(ConfigError) as error:
        checked(tmp_path, f"model.init_from={json.dumps(str(tmp_path / 'hf'))}", "model.hidden_size=64",
             "model.num_key_value_heads=4", "model.rope_theta=500000.0")
    message = str(error.value)
    for key in ("hidden_size", "num_key_value_heads", "rope_theta", "tie_word_embeddings"):
        assert f"model.{key} = " in message, message
    assert "config.json has hidden_size = 32" in message
    assert "vocab_size" not in message and "num_hidden_layers" not in message


def test_unsupported_hf_architecture_is_named(tmp_path):
    hf_folder(tmp_path / "hf", tied=True)
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "hidden_act": "gelu", "mlp_bias": True}))
    with pytest.raises(ConfigError, match=r"hidden_act = 'gelu'.*\(model_type = 'llama'\)\n.*mlp_bias"):
        checked(tmp_path, f"model.init_from={json.dumps(str(tmp_path / 'hf'))}")


def test_hf_weights_with_a_header_longer_than_the_first_read(tmp_path):
    from safetensors.torch import save_file

    many = {f"model.layers.{i}.input_layernorm.weight": torch.full((4,), float(i)) for i in range(1500)}
    save_file(many, str(tmp_path / "model.safetensors"))               # a header of > 64 KiB
    weights = HFWeights(str(tmp_path))
    assert len(weights.names()) == 1500
    assert torch.equal(weights.read("model", "model.layers.1499.input_layernorm.weight", (1,), (2,)),
                       torch.full((2,), 1499.0))


def test_pickle_only_hf_folder_is_refused_clearly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(HFFormatError, match="safetensors only"):
        read_hf(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# RoPE scaling through init_from → train → export, and what an HF config.json may not say


def test_published_llama3_config_json_is_read_as_transformers_reads_it(tmp_path):
    """Llama 3.1/3.2 publish rope_scaling + a top-level rope_theta (transformers 4's layout)."""
    scaled_hf_folder(tmp_path / "hf", LLAMA3)
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    del config["rope_parameters"]
    path.write_text(json.dumps({**config, "rope_scaling": LLAMA3, "rope_theta": 10000.0}))
    init = f"model.init_from={json.dumps(str(tmp_path / 'hf'))}"
    checked(tmp_path, init, *SCALED_MODEL, f"model.rope_scaling={toml_table(LLAMA3)}")   # accepted
    with pytest.raises(ConfigError) as error:
        checked(tmp_path, init, *SCALED_MODEL, "model.rope_theta=500000.0",
             f"model.rope_scaling={toml_table({**LLAMA3, 'factor': 32.0})}")
    assert "model.rope_scaling.factor = 32.0, but" in str(error.value)
    assert "config.json has rope_scaling.factor = 8.0" in str(error.value)
    assert "model.rope_theta = 500000.0, but" in str(error.value) and "has rope_theta = 10000.0" in str(error.value)
    # Without original_max_position_embeddings transformers uses max_position_embeddings (128), and so does the check.
    path.write_text(json.dumps({**config, "rope_scaling": {k: v for k, v in LLAMA3.items()
                                                           if k != "original_max_position_embeddings"}}))
    with pytest.raises(ConfigError, match="original_max_position_embeddings = 32, but .* = 128"):
        checked(tmp_path, init, *SCALED_MODEL, f"model.rope_scaling={toml_table(LLAMA3)}")


def test_legacy_type_key_and_default_rope_type(tmp_path):
    hf_folder(tmp_path / "hf", tied=True)
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    init = f"model.init_from={json.dumps(str(tmp_path / 'hf'))}"
    path.write_text(json.dumps({**config, "rope_scaling": {"rope_type": "default"}}))
    assert checked(tmp_path, init).model.rope_scaling is None                        # plain RoPE, as HF reads it
    assert checked(tmp_path, init, 'model.rope_scaling={rope_type = "default"}').model.rope_scaling.rope_type == "default"
    path.write_text(json.dumps({**config, "rope_scaling": {"type": "linear", "factor": 2.0}}))   # HF's legacy key
    assert checked(tmp_path, init, 'model.rope_scaling={type = "linear", factor = 2.0}').model.rope_scaling.factor == 2.0
    with pytest.raises(ConfigError, match=r"model.rope_scaling.factor = 3.0, but .*has rope_scaling.factor = 2.0"):
        checked(tmp_path, init, 'model.rope_scaling={rope_type = "linear", factor = 3.0}')


@pytest.mark.parametrize("table, message", [
    ('{rope_type = "llama3", factor = 8.0}', 'model.rope_scaling.low_freq_factor: required with rope_type = "llama3"'),
    ('{rope_type = "linear"}', 'model.rope_scaling.factor: required with rope_type = "linear"'),
    ('{rope_type = "default", factor = 2.0}', 'model.rope_scaling.factor: not used by rope_type = "default"'),
    ('{rope_type = "linear", factor = -2.0}', "factor"),
    ('{rope_type = "llama3", factor = 8.0, low_freq_factor = 4.0, high_freq_factor = 1.0, '
     'original_max_position_embeddings = 32}', "low_freq_factor = 4.0 must be below high_freq_factor = 1.0"),
    ('{rope_type = "dynamic", factor = 4.0}', "model.rope_scaling.rope_type = 'dynamic': nanoflow implements"),
    ('{rope_type = "longrope", factor = 4.0}', "model.rope_scaling.rope_type = 'longrope': nanoflow implements"),
    ('{rope_type = "lama3"}', 'did you mean "llama3"'),
    ('{rope_type = "yran", factor = 4.0}', 'did you mean "yarn"'),
    ('{rope_type = "linear", factor = 2.0, beta_fast = 32}',
     'model.rope_scaling.beta_fast: not used by rope_type = "linear"'),
    ('{rope_type = "yarn", factor = 4.0, low_freq_factor = 1.0}',
     'model.rope_scaling.low_freq_factor: not used by rope_type = "yarn"'),
    ('{rope_type = "yarn", factor = 4.0, truncate = 0}', "truncate"),
    ('{rope_type = "yarn", factor = 4.0, beta_fast = 0}', "beta_fast"),
    ('{rope_type = "yarn", factor = 4.0, rope_bad = 1}', "unknown key 'rope_bad'"),
    ('{type = "linear", rope_type = "llama3", factor = 2.0}', "disagree"),
])
def test_bad_rope_scaling_is_named_at_load(tmp_path, table, message):
    with pytest.raises(ConfigError) as error:
        tiny(tmp_path, f"model.rope_scaling={table}")
    assert message in str(error.value) and "tiny.toml" in str(error.value), str(error.value)


REFUSED = [   # config.json key, value, what the message says
    ("attention_dropout", 0.1, "attention_dropout = 0.1"),
    ("mlp_bias", True, "mlp_bias = true"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("pretraining_tp", 2, "pretraining_tp = 2"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type = 'dynamic'"),
    ("rope_scaling", {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
     "rope_scaling.rope_type = 'longrope'"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor = 0.5"),
    ("sliding_window", 16, "sliding_window = 16"),
    ("layer_types", ["sliding_attention", "full_attention"], "layer_types = ['full_attention', 'sliding_attention']"),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization_config"),
    ("model_type", "qwen3_moe", "model_type = 'qwen3_moe' (a mixture of experts)"),
    ("model_type", "gemma2", "model_type = 'gemma2' (logit soft-capping)"),
    ("architectures", ["LlamaForSequenceClassification"], "architectures = ['LlamaForSequenceClassification']"),
    ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters by layer type"),
]


@pytest.mark.parametrize("key, value, message", REFUSED, ids=[f"{k}={v}"[:40] for k, v, _ in REFUSED])
def test_config_json_key_that_changes_the_numbers_is_refused(tmp_path, capsys, key, value, message):
    from nanoflow.commands.cli import train_main

    hf_folder(tmp_path / "hf", tied=True)
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    status = train_main([str(TINY), "--set", f"checkpoints.checkpoints_path={json.dumps(str(tmp_path / 'run'))}",
                         "--set", f"model.init_from={json.dumps(str(tmp_path / 'hf'))}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"model.init_from: {path}: {message}" in err and "not supported" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    # The same check when a notebook builds the state without preflight.
    with pytest.raises(ConfigError, match=re.escape(message)):
        nanoflow.init_state(tiny(tmp_path, f"model.init_from={json.dumps(str(tmp_path / 'hf'))}"))


@pytest.mark.parametrize("key, value", [("attention_dropout", 0.0), ("pretraining_tp", 1), ("sliding_window", None),
                                        ("hidden_act", "swish"), ("partial_rotary_factor", 1.0)])
def test_config_json_keys_that_change_nothing_are_accepted(tmp_path, key, value):
    hf_folder(tmp_path / "hf", tied=True)
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    checked(tmp_path, f"model.init_from={json.dumps(str(tmp_path / 'hf'))}")


# ---------------------------------------------------------------------------------------------
# An HF folder whose tensors are not the ones its config.json describes: refused from the headers

def damaged(folder: Path, change) -> None:
    """Rewrite folder/model.safetensors with change(tensors) applied, as safetensors itself writes it."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def llamafied_biases(tensors):
    for layer in range(2):
        for proj, width in (("q", 32), ("k", 16), ("v", 16)):
            tensors[f"model.layers.{layer}.self_attn.{proj}_proj.bias"] = torch.zeros(width)


DAMAGE = [
    ("no lm_head", False, lambda t: t.pop("lm_head.weight"),
     ["missing lm_head.weight", "tie_word_embeddings = false, so the output head lm_head.weight must be stored"]),
    ("q/k/v biases", True, llamafied_biases,
     ["unexpected model.layers.0.self_attn.k_proj.bias, model.layers.0.self_attn.q_proj.bias",
      "model.layers.1.self_attn.v_proj.bias", 'describes a llama without these biases (a Qwen2 "llamafied" with its '
      'q/k/v biases is a qwen2: model_type = "qwen2" in its config.json)']),
    ("a shape", True, lambda t: t.update({"model.norm.weight": torch.ones(16)}),
     ["model.norm.weight has shape [16], the model expects [32]"]),
    ("a dtype", True, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int8)}),
     ["model.norm.weight is stored as I8, not a floating-point type"]),
]


@pytest.mark.parametrize("tied, damage, lines", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_hf_folder_whose_tensors_do_not_match_its_config_json_is_refused_before_training(tmp_path, capsys, tied,
                                                                                            damage, lines):
    from nanoflow.commands.cli import train_main

    hf_folder(tmp_path / "hf", tied=tied)
    damaged(tmp_path / "hf", damage)
    settings = ["--set", f"checkpoints.checkpoints_path={json.dumps(str(tmp_path / 'run'))}", "--set",
                f"model.init_from={json.dumps(str(tmp_path / 'hf'))}"]
    if not tied:
        settings += ["--set", "model.tie_word_embeddings=false"]
    for plan in (["--plan"], []):
        status = train_main([str(TINY), *settings, *plan])
        err = capsys.readouterr().err
        assert status == 2, err
        assert f"model.init_from: {tmp_path / 'hf'}: its safetensors files do not hold the weights" in err, err
        assert all(line in err for line in lines), err
        assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cli_refuses_attention_dropout_with_exit_2(tmp_path, capsys):
    hf_folder(tmp_path / "hf", tied=True)
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "attention_dropout": 0.1}))
    result = run_in_process("train", *train_args(tmp_path / "run", f"model.init_from={json.dumps(str(tmp_path / 'hf'))}"),
                            capsys=capsys)
    assert result.returncode == 2, result.stderr
    assert f"{path}: attention_dropout = 0.1" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# generation_config.json of a run started from a released model (issue 30, item 22)


def test_a_released_bases_stop_ids_gain_the_chat_templates_end_of_turn_and_keep_the_rest():
    from nanoflow.interop.export import _with_stops

    base = {"bos_token_id": 1, "eos_token_id": 256, "temperature": 0.6}
    assert _with_stops(base, [256, 300]) == {**base, "eos_token_id": [256, 300]}   # a base model tuned to chat
    instruct = {**base, "eos_token_id": [300, 256]}
    assert _with_stops(instruct, [256, 300]) == instruct                            # already stops there: as it was
    assert _with_stops(base, 256) == base and _with_stops(base, None) == base      # no template: the base's
    assert _with_stops({"temperature": 0.6}, [256]) == {"temperature": 0.6, "eos_token_id": 256}
