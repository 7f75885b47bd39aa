"""HF interop over trained runs: export gives transformers nanoflow's logits, tokenizers and generation_config
exported, `[model] init_from = <HF folder>` trains (tests/unit/test_hf.py: import and the refusals)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import transformers
from process_helpers import run_in_process, train_args
from support.hf import LLAMA3, SCALED_MODEL, checked, hf_folder, scaled_hf_folder, tiny, toml_table

import nanoflow
from nanoflow import ConfigError
from nanoflow.interop.export import export_hf
from nanoflow.io import read_hf, read_model
from nanoflow.io.hf import HFWeights, read_init_weights
from nanoflow.training.loop import train

MODEL_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings")


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def test_export_gives_transformers_the_same_logits(trained, tmp_path):
    run, state = trained
    summary = export_hf(str(run), str(tmp_path / "hf"))
    assert summary["step"] == 3 and summary["dtype"] == "float32"
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (None, 256, None)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_scaling"] is None and config["rope_parameters"]["rope_type"] == "default"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32" and config["eos_token_id"] == 256 and config["tie_word_embeddings"]
    for key in MODEL_KEYS:
        assert config[key] == getattr(state.config.model, key), key

    ids = torch.randint(0, 288, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = state.model(ids)
    theirs = hf_logits(tmp_path / "hf", ids)
    assert ours.abs().max() > 0.1
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_export_untied_from_a_step_folder_sharded(tmp_path):
    state = train(tiny(tmp_path, "tokens.train_steps=2", "model.tie_word_embeddings=false"), out=io.StringIO())
    out = tmp_path / "hf"
    export_hf(str(tmp_path / "run" / "2"), str(out), max_shard_size=20_000)   # the step folder, tiny shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == set(shards)
    assert "lm_head.weight" in index["weight_map"]
    params = dict(state.model.named_parameters())
    assert set(index["weight_map"]) == set(params)
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in params.values())
    for shard in out.glob("model-*.safetensors"):   # each shard within the limit, unless one tensor alone exceeds it
        names = [k for k, v in index["weight_map"].items() if v == shard.name]
        assert len(names) == 1 or sum(params[k].numel() * 4 for k in names) <= 20_000

    ids = torch.randint(0, 288, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = state.model(ids)
    assert (ours - hf_logits(out, ids)).abs().max().item() <= 1e-4


def test_export_bfloat16(trained, tmp_path):
    run, state = trained
    export_hf(str(run), str(tmp_path / "hf"), dtype="bfloat16")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, tensors = read_hf(str(tmp_path / "hf"))
    for name, p in state.model.named_parameters():
        assert tensors[name].dtype == torch.bfloat16 and torch.equal(tensors[name], p.detach().to(torch.bfloat16))


def test_byte_tokenizer_exports_as_an_equivalent_autotokenizer(trained, tmp_path):
    run, _ = trained
    export_hf(str(run), str(tmp_path / "hf"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "héllo, wörld 🙂\n\t12+30=42"
    assert tokenizer(text)["input_ids"] == list(text.encode())
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 256
    assert tokenizer.decode(list(text.encode())) == text


def test_tokenizer_json_run_exports_its_tokenizer(tmp_path):
    import tokenizers  # a test extra
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<s>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x): return x + 1", "1+2=3", "the quick brown fox"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    path = json.dumps(str(tmp_path / "tokenizer.json"))
    train(tiny(tmp_path, "tokens.train_steps=1", f"tokenizer.tokenizer_name_or_path={path}"), out=io.StringIO())
    summary = export_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert summary["tokenizer"].endswith("tokenizer.json")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation == {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1}
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def g(y): return y + 2"
    assert loaded(text)["input_ids"] == tok.encode(text, add_special_tokens=False).ids
    assert loaded.eos_token_id == 1


def test_init_from_hf_folder_trains(tmp_path):
    expected = hf_folder(tmp_path / "hf", tied=True)
    config = tiny(tmp_path, "tokens.train_steps=2", f"model.init_from={json.dumps(str(tmp_path / 'hf'))}")
    assert nanoflow.init_state(config).model.model.norm.weight.tolist() == expected["model.norm.weight"].tolist()
    state = train(config, out=io.StringIO())
    assert state.step == 2
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["loss"] == m["loss"] for m in metrics)
    trained = read_model(str(tmp_path / "run"))
    assert not torch.equal(trained["model.norm.weight"], expected["model.norm.weight"])   # it did train


def test_init_state_checks_too_and_read_init_weights_reads_checkpoints(trained, tmp_path):
    run, state = trained
    reader = read_init_weights(str(run))   # a nanoflow run folder: its latest checkpoint
    assert torch.equal(reader.read("model", "model.norm.weight"), state.model.model.norm.weight.detach())
    hf_folder(tmp_path / "hf", tied=True)
    other = tiny(tmp_path, "model.num_hidden_layers=3", f"model.init_from={json.dumps(str(tmp_path / 'hf'))}")
    with pytest.raises(ConfigError, match="num_hidden_layers = 3, but .*config.json has num_hidden_layers = 2"):
        nanoflow.init_state(other)   # a notebook that skips preflight is still told, before a weight is read


def test_init_from_an_hf_folder_reads_only_the_rows_of_a_box(trained, tmp_path):
    run, state = trained
    export_hf(str(run), str(tmp_path / "hf"), max_shard_size=30_000)   # sharded: the index says where
    weights = HFWeights(str(tmp_path / "hf"))
    asked, read_range = [], weights.store.read_range
    weights.store.read_range = lambda f, start, length: asked.append(length) or read_range(f, start, length)
    name = "model.layers.1.mlp.down_proj.weight"
    full = dict(state.model.named_parameters())[name].detach()
    assert weights.shape("model", name) == tuple(full.shape)
    assert torch.equal(weights.read("model", name, (2, 4), (3, 8)), full[2:5, 4:12])
    assert asked[-1] == 3 * full.shape[1] * full.element_size()     # three rows' bytes, not the whole weight
    assert torch.equal(weights.read("model", name), full)


LINEAR = {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("rope_scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_rope_scaled_hf_folder_trains_and_exports_with_its_scaling(tmp_path, rope_scaling):
    source = scaled_hf_folder(tmp_path / "hf_in", rope_scaling)
    init = f"model.init_from={json.dumps(str(tmp_path / 'hf_in'))}"
    other = {"rope_type": "linear", "factor": 3.0} if rope_scaling["rope_type"] == "llama3" else {**LLAMA3}
    with pytest.raises(ConfigError, match=rf"model.rope_scaling.rope_type = '{other['rope_type']}', but "
                                          rf".*config.json has rope_parameters.rope_type = '{rope_scaling['rope_type']}'"):
        checked(tmp_path, init, *SCALED_MODEL, f"model.rope_scaling={toml_table(other)}")
    # Unset, [model.rope_scaling] is config.json's; stated, it must be the same.
    assert checked(tmp_path, init, *SCALED_MODEL).model.rope_scaling == \
        checked(tmp_path, init, *SCALED_MODEL, f"model.rope_scaling={toml_table(rope_scaling)}").model.rope_scaling
    config = checked(tmp_path, init, *SCALED_MODEL, "tokens.train_steps=3")
    ids = torch.randint(0, 288, (2, 100), generator=torch.Generator().manual_seed(0))   # past L = 32
    with torch.no_grad():
        assert (nanoflow.init_state(config).model(ids) - source(ids).logits).abs().max().item() <= 1e-5

    state = train(config, out=io.StringIO())
    assert state.step == 3 and state.config.model.rope_scaling.rope_type == rope_scaling["rope_type"]
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf_out"))
    exported = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    assert exported["rope_scaling"] == rope_scaling
    assert exported["rope_parameters"] == {**rope_scaling, "rope_theta": 10000.0}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", dtype=torch.float32).eval()
    assert reloaded.config.rope_parameters["rope_type"] == rope_scaling["rope_type"]
    with torch.no_grad():
        ours, theirs = state.model(ids), reloaded(ids).logits
        assert (ours - source(ids).logits).abs().max().item() > 1e-3   # it trained
    assert ours.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= 1e-5
    # The exported folder is itself a valid init_from for the same [model].
    checked(tmp_path, f"model.init_from={json.dumps(str(tmp_path / 'hf_out'))}", *SCALED_MODEL,
         f"model.rope_scaling={toml_table(rope_scaling)}")


def test_init_from_a_checkpoint_of_another_shape_is_exit_2_not_a_traceback(trained, tmp_path):
    run, _ = trained
    config = tiny(tmp_path, "model.intermediate_size=48", f"model.init_from={json.dumps(str(run))}")
    with pytest.raises(nanoflow.io.CheckpointError, match=r"the weights do not fit the model:\n  "
                       r"model.layers.0.mlp.gate_proj.weight has shape \[64, 32\], the model expects \[48, 32\]\n"):
        nanoflow.init_state(config)


@pytest.mark.slow
def test_cli_export_and_mismatch_exit_status(trained, tmp_path, capsys):
    run, _ = trained
    result = run_in_process("export", str(run), str(tmp_path / "hf"), "--max-shard-size", "30KB", capsys=capsys)
    assert result.returncode == 0, result.stderr
    assert "exported step 3" in result.stdout and (tmp_path / "hf" / "model.safetensors.index.json").exists()

    result = run_in_process("train", *train_args(tmp_path / "run2", f"model.init_from={json.dumps(str(tmp_path / 'hf'))}",
                                                 "model.hidden_size=64"), capsys=capsys)
    assert result.returncode == 2, result.stderr
    assert "model.init_from: model.hidden_size = 64, but" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run2").exists()

    result = run_in_process("export", str(tmp_path / "nothing"), str(tmp_path / "x"), capsys=capsys)
    assert result.returncode == 2 and "holds no" in result.stderr, result.stderr


def released_folder(path: Path, **generation) -> transformers.GenerationConfig:
    """tiny's model as a released folder: saved by transformers with its own generation_config.json."""
    config = transformers.LlamaConfig(vocab_size=288, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    model.generation_config = transformers.GenerationConfig(**generation)
    model.save_pretrained(path)
    return transformers.GenerationConfig.from_pretrained(path)


SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
            "max_new_tokens": 40}


@pytest.mark.parametrize("eos, expected_eos", [
    ([256, 270, 271], [256, 270, 271]),   # the run's end-of-text is one of the base's stop ids: all kept
    (256, 256),
    ([270, 271], 256),                    # it is not: the run's replaces them, as TRL's clone_chat_template does
])
def test_export_of_a_run_started_from_a_released_model_keeps_its_generation_config(tmp_path, eos, expected_eos):
    base = released_folder(tmp_path / "released", bos_token_id=1, eos_token_id=eos, pad_token_id=272, **SAMPLING)
    init = f"model.init_from={json.dumps(str(tmp_path / 'released'))}"
    train(tiny(tmp_path, "tokens.train_steps=2", init), out=io.StringIO())
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    exported = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert exported.eos_token_id == expected_eos
    assert (exported.bos_token_id, exported.pad_token_id) == (1, 272)   # the byte tokenizer has neither to differ
    for key, value in SAMPLING.items():
        assert getattr(exported, key) == getattr(base, key) == value, key
    kept = {k: v for k, v in base.to_diff_dict().items() if k not in ("eos_token_id", "transformers_version")}
    assert {k: v for k, v in exported.to_diff_dict().items() if k in kept} == kept

    # A branch of that run (resume_checkpoint_path, no init_from of its own) exports the base's too.
    branch = tiny(tmp_path, "tokens.train_steps=3", f"checkpoints.resume_checkpoint_path={json.dumps(str(tmp_path / 'run'))}",
                  run="branch")
    train(branch, out=io.StringIO())
    export_hf(str(tmp_path / "branch"), str(tmp_path / "hf_branch"))
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf_branch").to_diff_dict() == exported.to_diff_dict()


def test_export_of_a_run_whose_base_has_no_generation_config_derives_it_from_the_tokenizer(tmp_path):
    hf_folder(tmp_path / "hf_in", tied=True)
    (tmp_path / "hf_in" / "generation_config.json").unlink()
    train(tiny(tmp_path, "tokens.train_steps=1", f"model.init_from={json.dumps(str(tmp_path / 'hf_in'))}"),
          out=io.StringIO())
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"_from_model_config": True,
                                                                                   "eos_token_id": 256}

