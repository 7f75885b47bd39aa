"""RoPE per stage and YaRN: YaRN's frequencies and attention factor against transformers' own models (Llama and
Qwen3, float32, past original_max_position_embeddings), a stage's RoPE against transformers' model with that RoPE,
the one function that says which RoPE each stage trains with, and the errors of a stage's RoPE keys."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from helpers import tiny

import nanoflow
from nanoflow import ConfigError
from nanoflow.config import Rope, RopeScalingArgs, config_from_dict, stage_rope
from nanoflow.config.rope import stage_ropes
from nanoflow.model import rope_attention_scaling, rope_inv_freq
from nanoflow.run import open_run

# head_dim 16, theta 10000, original context 256: the first frequency makes 41 rotations over it (kept: > 32), the
# next three 13 to 1.3 (blended), the rest under 1 (divided by factor) — every band of YaRN holds some.
ORIGINAL = 256
LENGTH = 320                         # the positions tested, past ORIGINAL
SIZES = dict(vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.1,
             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
YARN = {   # rope_parameters beyond rope_type, as Qwen2.5/Qwen3 and DeepSeek publish them, and transformers' other keys
    "factor": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "mscale-ratio": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL, "mscale": 0.707,
                     "mscale_all_dim": 1.0},
    "mscale-alone": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL, "mscale": 0.707},
    "attention_factor": {"factor": 8.0, "original_max_position_embeddings": ORIGINAL, "attention_factor": 0.8},
    "no-truncate-betas": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL, "truncate": False,
                          "beta_fast": 16.0, "beta_slow": 2.0},
    "factor-null": {"factor": None, "original_max_position_embeddings": ORIGINAL},   # 1024 / 256 = 4
}
IDS = torch.randint(0, 288, (2, LENGTH), generator=torch.Generator().manual_seed(1))


def hf_model(family: str, rope_parameters: dict, seed: int = 0) -> transformers.PreTrainedModel:
    """A random float32 transformers model of `family` (Qwen3: head_dim stated, q/k norms), its norms drawn too."""
    config_class = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}
    config = config_class(**SIZES, **extra, rope_parameters=dict(rope_parameters))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def init_from(tmp_path: Path, folder: Path, *overrides: str, model: dict | None = None):
    """tiny.toml whose [model] is `init_from = folder` (and `model`), completed as bin/train completes it."""
    raw = tiny(tmp_path / "run").to_dict()
    raw["model"] = {**(model or {}), "init_from": str(folder)}
    return open_run(config_from_dict(raw, "test.toml", list(overrides)), join=False).config


def logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


# ---------------------------------------------------------------------------------------------
# YaRN, exactly as transformers computes it

def test_the_test_frequencies_fall_in_every_band_of_yarn():
    rotations = [ORIGINAL / (2 * math.pi * 10000.0 ** (i / 16)) for i in range(0, 16, 2)]
    assert rotations[0] > 32 and 1 < rotations[3] < 32 and rotations[4] < 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("name", YARN)
def test_an_hf_yarn_folder_gives_transformers_logits_past_the_original_context(tmp_path, family, name):
    table = {"rope_type": "yarn", "rope_theta": 10000.0, **YARN[name]}
    source = hf_model(family, table)
    rotary = source.model.rotary_emb
    source.save_pretrained(tmp_path / "hf")
    config = init_from(tmp_path, tmp_path / "hf")
    scaling = config.model.rope_scaling
    assert scaling.rope_type == "yarn"
    rope = stage_rope(config, 0)
    assert torch.equal(rope_inv_freq(16, rope.theta, rope.scaling), rotary.inv_freq)   # bit for bit
    assert rope_attention_scaling(rope.scaling) == rotary.attention_scaling
    ours = nanoflow.init_state(config).model
    theirs = logits(source)
    assert theirs.abs().max() > 1.0
    assert (logits(ours) - theirs).abs().max().item() <= 1e-5
    # YaRN changes these numbers: the same weights with plain RoPE give other logits
    ours.set_rope(10000.0, None)
    assert (logits(ours) - theirs).abs().max().item() > 1e-3


def test_yarn_attention_factor_is_transformers_for_each_way_of_giving_it():
    expected = {"factor": 0.1 * math.log(4) + 1, "mscale-ratio": (0.1 * 0.707 * math.log(4) + 1) / (0.1 * math.log(4) + 1),
                "mscale-alone": 0.1 * math.log(4) + 1, "attention_factor": 0.8, "no-truncate-betas": 0.1 * math.log(4) + 1,
                "factor-null": 0.1 * math.log(4) + 1}
    for name, table in YARN.items():
        scaling = Rope.of(1e4, RopeScalingArgs("yarn", **table), 1024).scaling
        assert rope_attention_scaling(scaling) == pytest.approx(expected[name], rel=1e-12), name
    assert rope_attention_scaling(RopeScalingArgs("linear", factor=4.0)) == 1.0
    assert rope_attention_scaling(Rope.of(1e4, RopeScalingArgs("yarn", factor=0.5), 64).scaling) == 1.0   # factor ≤ 1


def test_yarn_keys_config_json_leaves_out_are_read_as_transformers_reads_them(tmp_path):
    """original_max_position_embeddings absent: max_position_embeddings; a top-level one wins over the table's
    (transformers' config holds it as an attribute); truncate null is false, absent true."""
    source = hf_model("llama", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    source.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    saved = json.loads(path.read_text())
    cases = [({"factor": 4.0}, {}, 1024, None),
             ({"factor": 4.0, "original_max_position_embeddings": 512}, {"original_max_position_embeddings": 256}, 256,
              None),
             ({"factor": 4.0, "original_max_position_embeddings": 256, "truncate": None}, {}, 256, False)]
    for table, top, original, truncate in cases:
        path.write_text(json.dumps({**saved, **top, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, **table}}))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
        config = init_from(tmp_path, tmp_path / "hf")
        scaling = stage_rope(config, 0).scaling
        assert (scaling.original_max_position_embeddings, scaling.truncate) == (original, truncate)
        assert torch.equal(rope_inv_freq(16, 1e4, scaling), reloaded.model.rotary_emb.inv_freq)
        assert (logits(nanoflow.init_state(config).model) - logits(reloaded)).abs().max().item() <= 1e-5


def test_a_yarn_model_rope_scaling_must_compute_what_config_json_computes(tmp_path):
    hf_model("qwen3", {"rope_type": "yarn", "rope_theta": 10000.0, **YARN["factor"]}).save_pretrained(tmp_path / "hf")
    same = '{rope_type = "yarn", factor = 4.0, original_max_position_embeddings = 256, beta_fast = 32.0, truncate = true}'
    assert init_from(tmp_path, tmp_path / "hf", f"model.rope_scaling={same}").model.rope_scaling.beta_fast == 32.0
    implied = '{rope_type = "yarn", original_max_position_embeddings = 256}'   # factor: 1024 / 256, config.json's
    assert init_from(tmp_path, tmp_path / "hf", f"model.rope_scaling={implied}").model.rope_scaling.factor is None
    with pytest.raises(ConfigError) as error:
        init_from(tmp_path, tmp_path / "hf",
                  'model.rope_scaling={rope_type = "yarn", factor = 4.0, original_max_position_embeddings = 256, '
                  'beta_fast = 16.0}')
    assert "model.rope_scaling.beta_fast = 16.0, but" in str(error.value)
    assert "config.json has rope_parameters.beta_fast = None (32)" in str(error.value)
    with pytest.raises(ConfigError, match=r"model.rope_scaling.original_max_position_embeddings = unset \(1024\), "
                                          r"but .*config.json has rope_parameters.original_max_position_embeddings = 256"):
        init_from(tmp_path, tmp_path / "hf", 'model.rope_scaling={rope_type = "yarn", factor = 4.0}')
    with pytest.raises(ConfigError, match=r"write model.rope_scaling = \{rope_type = \"yarn\", factor = 4.0, "
                                          r"original_max_position_embeddings = 256\}"):
        init_from(tmp_path, tmp_path / "hf", 'model.rope_scaling={rope_type = "linear", factor = 4.0}')


def test_a_bad_yarn_value_in_config_json_is_named(tmp_path):
    hf_model("llama", {"rope_type": "yarn", "rope_theta": 10000.0, **YARN["factor"]}).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "rope_parameters": {**saved["rope_parameters"], "truncate": "yes"}}))
    with pytest.raises(ConfigError, match=r"config.json: rope_parameters.truncate = 'yes': not a valid value"):
        init_from(tmp_path, tmp_path / "hf")


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                            "mscale": 1.0, "mscale_all_dim": 0.5}],
                         ids=["theta", "yarn"])
def test_a_stage_rope_computes_what_transformers_computes_with_that_rope(tmp_path, scaling):
    """A fresh model's stage with rope_theta T (and a yarn table): the logits of transformers' model with rope_theta
    T (and that yarn table), on the same weights, once the model has the stage's RoPE."""
    table = "" if scaling is None else "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in scaling.items()) + "}"
    config = tiny(tmp_path / "run", "model.hidden_size=64", "model.max_position_embeddings=1024",
                  "data_stages.sft.rope_theta=500000.0",
                  *([f"data_stages.sft.rope_scaling={table}"] if scaling else []))
    model = nanoflow.init_state(config).model
    before = logits(model)
    rope = stage_rope(config, 1)
    model.set_rope(rope.theta, rope.scaling)
    m = config.model
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=True,
        rope_parameters={"rope_theta": 500000.0, **(scaling or {"rope_type": "default"})})).float().eval()
    theirs.load_state_dict(model.state_dict(), strict=True)
    assert (logits(model) - logits(theirs)).abs().max().item() <= 1e-5
    assert (logits(model) - before).abs().max().item() > 1e-4   # the stage's RoPE is not the first stage's


# ---------------------------------------------------------------------------------------------
# The RoPE of each stage: one pure function, and the errors of a stage's keys

LINEAR = RopeScalingArgs("linear", factor=2.0)
YARN4 = RopeScalingArgs("yarn", factor=4.0, original_max_position_embeddings=256)


def test_a_stage_keeps_the_previous_stages_rope_key_by_key():
    ropes = stage_ropes(1e4, None, 1024, [(None, None), (5e5, None), (None, YARN4), (None, None),
                                          (None, RopeScalingArgs("default")), (2e6, LINEAR)])
    assert ropes == (Rope(1e4), Rope(5e5), Rope(5e5, YARN4), Rope(5e5, YARN4), Rope(5e5), Rope(2e6, LINEAR))
    # [model]'s scaling is the first stage's; yarn's two defaults come from max_position_embeddings
    first, second = stage_ropes(1e4, RopeScalingArgs("yarn"), 1024, [(None, None), (None, None)])
    assert first == second == Rope(1e4, RopeScalingArgs("yarn", factor=1.0, original_max_position_embeddings=1024))
    resolved = stage_ropes(1e4, None, 1024, [(None, RopeScalingArgs("yarn", original_max_position_embeddings=128))])
    assert resolved[0].scaling.factor == 8.0


def test_stage_rope_reads_the_config_in_schedule_order(tmp_path):
    config = tiny(tmp_path / "run", "data_stages.sft.rope_theta=500000.0",
                  'data_stages.sft.rope_scaling={rope_type = "linear", factor = 2.0}',
                  "data_stages.sft.start_training_step=1", "data_stages.pretrain.start_training_step=8")
    assert [stage.name for stage in config.data_stages] == ["sft", "pretrain"]
    assert stage_rope(config, 0) == stage_rope(config, 1) == Rope(500000.0, LINEAR)   # "pretrain" follows "sft"
    assert stage_rope(tiny(tmp_path / "run"), 1) == Rope(10000.0)
    text = Rope(500000.0, YARN4).describe(), Rope(1e4).describe(), Rope(0.5, LINEAR).describe()
    assert text == ("θ 500,000, yarn ×4 of 256", "θ 10,000", "θ 0.5, linear ×2")


@pytest.mark.parametrize("override, message", [
    ('data_stages.sft.rope_scaling={rope_type = "linear"}',
     'data_stages[1] (stage "sft").rope_scaling.factor: required with rope_type = "linear"'),
    ('data_stages.sft.rope_scaling={rope_type = "dynamic", factor = 2.0}',
     "data_stages[1] (stage \"sft\").rope_scaling.rope_type = 'dynamic': nanoflow implements"),
    ('data_stages.pretrain.rope_scaling={rope_type = "yarn", factor = 2.0, low_freq_factor = 1.0}',
     'data_stages[0] (stage "pretrain").rope_scaling.low_freq_factor: not used by rope_type = "yarn"'),
    ('data_stages.sft.rope_scaling={rope_type = "yarn", fator = 2.0}',
     'data_stages[1] (stage "sft").rope_scaling: unknown key \'fator\' (did you mean \'factor\'?)'),
    ("data_stages.sft.rope_theta=-1.0", 'data_stages[1] (stage "sft"): \'rope_theta\' must be > 0'),
    ('data_stages.sft.rope_theta="1e6"', 'data_stages[1] (stage "sft").rope_theta: expected float, got str'),
])
def test_a_bad_stage_rope_is_named_with_its_stage_at_load(tmp_path, override, message):
    with pytest.raises(ConfigError) as error:
        tiny(tmp_path / "run", override)
    assert message in str(error.value) and "tiny.toml" in str(error.value), str(error.value)


def test_a_new_rope_does_not_recompile_a_compiled_layer(tmp_path):
    """cos and sin are computed outside the layers ([model] compile compiles each layer): a stage's RoPE reaches
    them as new values of the same tensors, so the compiled layers run on without recompiling."""
    from nanoflow.build import build_model

    config = tiny(tmp_path / "run", "model.compile=true", "data_stages.sft.rope_theta=500000.0",
                  'data_stages.sft.rope_scaling={rope_type = "yarn", factor = 2.0, original_max_position_embeddings = 32}')
    model = build_model(config)
    ids = torch.randint(0, 288, (2, 32), generator=torch.Generator().manual_seed(0))
    first = logits(model, ids)
    rope = stage_rope(config, 1)
    model.set_rope(rope.theta, rope.scaling)
    with torch.compiler.set_stance("fail_on_recompile"):
        second = logits(model, ids)
    model.set_rope(10000.0, None)
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(logits(model, ids), first)
    assert (second - first).abs().max().item() > 1e-4


def test_the_inverse_frequencies_reach_the_device_once_per_rope():
    # A forward on a GPU would otherwise copy them from the host every time, and wait for the copy.
    from nanoflow.model import _inv_freq_on
    scaling = RopeScalingArgs("linear", factor=4.0)
    first = _inv_freq_on(16, 5e5, scaling, torch.device("cpu"))
    assert _inv_freq_on(16, 5e5, RopeScalingArgs("linear", factor=4.0), torch.device("cpu")) is first
    assert torch.equal(first, rope_inv_freq(16, 5e5, scaling))
    assert not torch.equal(_inv_freq_on(16, 5e5, None, torch.device("cpu")), first)
