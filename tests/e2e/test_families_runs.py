"""The model families over whole runs: a run of each family exports what transformers loads with its logits, and
an average of a family's checkpoints exports as that family (tests/unit/test_families.py: the rest)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import tiny
from support.families import CLASSES, FRESH, IDS, SHAPES, logits

from nanoflow.config import FAMILIES
from nanoflow.interop.export import export_hf
from nanoflow.model import Llama
from nanoflow.training.loop import train


@pytest.mark.parametrize("shape", SHAPES)
def test_a_run_of_each_family_exports_what_transformers_loads_with_its_logits(tmp_path, shape):
    family, keys = SHAPES[shape]
    own = {k: v for k, v in keys.items() if k in ("head_dim", "tie_word_embeddings", "rope_theta")
           or k in FAMILIES[family].own_keys}   # a fresh [model] of that shape
    sets = [f"model.model_type={json.dumps(family)}", "model.num_hidden_layers=4", "model.hidden_size=64",
            "model.num_attention_heads=8", "model.num_key_value_heads=2", "tokens.train_steps=2",
            *(f"model.{k}={_toml(False if v is None else v)}" for k, v in own.items())]
    state = train(tiny(tmp_path / "run", *sets), out=_quiet())
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(reloaded).__name__ == FAMILIES[family].causal_lm
    ours, theirs = logits(state.model, IDS), logits(reloaded, IDS)
    assert (ours - theirs).abs().max().item() <= 1e-5 and ours.abs().max() > 0.1

    # config.json: what the family's own config class writes for the model's values, and what transformers 4 reads
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    m = state.config.model
    values = {key: getattr(m, key) for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                               "rms_norm_eps", "tie_word_embeddings", "initializer_range")}
    values.update(rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
                  architectures=[FAMILIES[family].causal_lm], dtype="float32", pad_token_id=None,
                  bos_token_id=exported["bos_token_id"], eos_token_id=exported["eos_token_id"])
    if hasattr(CLASSES[family](), "head_dim") or m.head_dim != 8:
        values["head_dim"] = m.head_dim
    values.update({key: getattr(m, key) for key in FAMILIES[family].own_keys})
    if family == "mistral" and m.sliding_window is False:
        values["sliding_window"] = None   # no window: config.json's null
    expected = CLASSES[family](**values).to_diff_dict()
    extra = {"rope_theta", "rope_scaling", "torch_dtype", "nanoflow"}   # transformers 4's keys, where it came from
    assert {k: v for k, v in exported.items() if k not in extra} == \
        {k: v for k, v in expected.items() if k != "transformers_version"}
    assert exported["rope_theta"] == m.rope_theta and exported["rope_scaling"] is None


def _toml(value) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


def _quiet():
    import io

    return io.StringIO()


def test_an_average_of_a_family_s_checkpoints_exports_as_that_family(tmp_path):
    from nanoflow import io
    from nanoflow.commands.cli import average_main

    config = tiny(tmp_path / "run", *FRESH["qwen3"], "tokens.train_steps=4", "checkpoints.checkpoint_interval=2")
    train(config, out=_quiet())
    assert average_main([str(tmp_path / "run"), str(tmp_path / "avg"), "--last", "2"]) == 0
    export_hf(str(tmp_path / "avg"), str(tmp_path / "hf"))
    ours = Llama(config.model)
    ours.load_state_dict(io.read_model(str(tmp_path / "avg")), strict=False)   # a tied lm_head is stored once
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    assert (logits(ours, IDS[:, :32]) - logits(theirs, IDS[:, :32])).abs().max().item() <= 1e-5

