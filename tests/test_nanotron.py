"""bin/convert-nanotron-config: nanotron YAML → a nanoflow TOML that loads, with every dropped key named."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoflow import load_config
from nanoflow.config import ConfigError
from nanoflow.nanotron import convert, to_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

# The shape of nanotron's examples/config_tiny_llama.yaml (as nanotron's own dump writes it), with local data.
NANOTRON_YAML = """
checkpoints:
  checkpoint_interval: 10
  checkpoints_path: checkpoints
  checkpoints_path_is_shared_file_system: false
  resume_checkpoint_path: null
  save_initial_state: false
data_stages:
- data:
    dataset:
      dataset_overwrite_cache: false
      dataset_processing_num_proc_per_process: 1
      hf_dataset_config_name: null
      hf_dataset_or_datasets: text
      hf_data_files: corpus/*.txt
      hf_dataset_splits: train
      text_column_name: text
    num_loading_workers: 1
    seed: 42
  name: Stable Training Stage
  start_training_step: 1
- data:
    dataset:
      hf_dataset_or_datasets: json
      hf_data_files: [sft.jsonl]
      prompt_column_name: prompt
      completion_column_name: completion
    num_loading_workers: 1
    seed: 7
  name: Annealing Phase
  start_training_step: 10
  sequence_length: 64
general:
  benchmark_csv_path: null
  consumed_train_samples: null
  ignore_sanity_checks: true
  project: debug
  run: tiny_llama_%date_%jobid
  seed: 42
  step: null
lighteval:
  batch_size: 16
logging:
  iteration_step_info_interval: 1
  log_level: info
  log_level_replica: info
model:
  ddp_bucket_cap_mb: 25
  dtype: bfloat16
  init_method:
    std: 0.025
  make_vocab_size_divisible_by: 1
  model_config:
    bos_token_id: 1
    eos_token_id: 2
    hidden_act: silu
    hidden_size: 16
    initializer_range: 0.02
    intermediate_size: 64
    is_llama_config: true
    max_position_embeddings: 256
    num_attention_heads: 4
    num_hidden_layers: 2
    num_key_value_heads: 4
    pad_token_id: null
    pretraining_tp: 1
    rms_norm_eps: 1.0e-05
    rope_scaling: null
    rope_theta: 10000.0
    tie_word_embeddings: true
    use_cache: true
    vocab_size: 257
optimizer:
  accumulate_grad_in_fp32: true
  clip_grad: 1.0
  learning_rate_scheduler:
    learning_rate: 0.0003
    lr_decay_starting_step: null
    lr_decay_steps: 13
    lr_decay_style: cosine
    lr_warmup_steps: 2
    lr_warmup_style: linear
    min_decay_lr: 1e-5
  optimizer_factory:
    adam_beta1: 0.9
    adam_beta2: 0.95
    adam_eps: 1.0e-08
    name: adamW
    torch_adam_is_fused: true
  weight_decay: 0.01
  zero_stage: 0
parallelism:
  dp: 2
  expert_parallel_size: 1
  pp: 2
  pp_engine: 1f1b
  recompute_layer: true
  tp: 2
  tp_linear_async_communication: true
  tp_mode: REDUCE_SCATTER
profiler:
  profiler_export_path: prof
s3_upload:
  upload_s3_path: s3://bucket/run
  remove_after_upload: true
tokenizer:
  tokenizer_max_length: null
  tokenizer_name_or_path: bytes
  tokenizer_revision: null
tokens:
  batch_accumulation_per_replica: 1
  limit_test_batches: 0
  limit_val_batches: 0
  micro_batch_size: 2
  sequence_length: 128
  train_steps: 15
  val_check_interval: -1
"""


def write_data(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world\n")
    (tmp_path / "sft.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')


def test_converted_config_loads_and_keeps_every_value(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    write_data(tmp_path)
    text, report = convert(yaml.safe_load(NANOTRON_YAML))
    (tmp_path / "schedule.toml").write_text(text)
    config = load_config(tmp_path / "schedule.toml")

    model = config.model
    assert (model.vocab_size, model.hidden_size, model.intermediate_size, model.num_hidden_layers) == (257, 16, 64, 2)
    assert (model.num_attention_heads, model.num_key_value_heads, model.max_position_embeddings) == (4, 4, 256)
    assert (model.rms_norm_eps, model.rope_theta, model.tie_word_embeddings) == (1e-5, 10000.0, True)
    assert model.dtype == "bfloat16" and model.initializer_range == 0.025   # init_method.std is what nanotron draws with
    assert (config.parallelism.dp, config.parallelism.tp, config.parallelism.tp_mode) == (2, 2, "REDUCE_SCATTER")
    assert (config.tokens.sequence_length, config.tokens.train_steps, config.tokens.micro_batch_size) == (128, 15, 2)
    lr = config.optimizer.learning_rate_scheduler
    assert (lr.learning_rate, lr.lr_warmup_steps, lr.lr_decay_steps, lr.min_decay_lr) == (3e-4, 2, 13, 1e-5)
    assert config.optimizer.optimizer_factory.torch_adam_is_fused and config.optimizer.weight_decay == 0.01
    assert config.checkpoints.checkpoint_interval == 10
    assert config.checkpoints.checkpoints_path == str(tmp_path / "checkpoints")
    assert [(s.name, s.start_training_step) for s in config.data_stages] == [
        ("Stable Training Stage", 1), ("Annealing Phase", 10)]
    assert config.data_stages[1].sequence_length == 64 and config.data_stages[1].data.seed == 7
    assert config.data_stages[1].data.dataset.is_sft
    assert (config.general.project, config.general.run) == ("debug", "tiny_llama_%date_%jobid")

    dropped = {key: value for key, value, _ in report.dropped}
    for key in ("parallelism.pp", "parallelism.pp_engine", "parallelism.recompute_layer", "lighteval", "profiler",
                "s3_upload", "optimizer.zero_stage", "tokens.val_check_interval", "checkpoints.save_initial_state",
                "model.model_config.bos_token_id", "general.ignore_sanity_checks"):
        assert key in dropped, key
    assert dropped["parallelism.pp"] == 2
    assert "model.init_method" not in dropped and "model.model_config.hidden_act" not in dropped  # carried / as is
    lines = report.lines()
    assert "not carried over: parallelism.pp = 2 (nanoflow has no pipeline parallelism: dp and tp only)" in lines
    assert any(line.startswith("ignored: optimizer.zero_stage = 0") for line in lines)
    assert any("min_decay_lr" in line and "1e-05" in line for line in lines)   # YAML 1.1 read 1e-5 as a string
    assert "# not carried over: lighteval = " in text   # the TOML says it too


def test_unsupported_values_are_named(tmp_path):
    raw = yaml.safe_load(NANOTRON_YAML)
    raw["model"]["model_config"]["hidden_act"] = "gelu"
    raw["model"]["model_config"]["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    raw["optimizer"]["optimizer_factory"]["name"] = "sgd"
    raw["data_stages"][1]["data"]["dataset"]["hf_dataset_or_datasets"] = ["a", "b"]
    text, report = convert(raw)
    lines = "\n".join(report.lines())
    assert 'not carried over: model.model_config.hidden_act = "gelu"' in lines
    assert "not carried over: model.model_config.rope_scaling" in lines
    assert "not carried over: optimizer.optimizer_factory.name = \"sgd\" (nanoflow supports 'adamW')" in lines
    assert 'data_stages[1].data.dataset.hf_dataset_or_datasets = ["a", "b"]' in lines
    write_data(tmp_path)
    (tmp_path / "schedule.toml").write_text(text)
    with pytest.raises(ConfigError, match=r'stage "Annealing Phase"\)\.data\.dataset'):
        load_config(tmp_path / "schedule.toml")


def test_nanoset_stages_and_blends_carry_over():
    raw = yaml.safe_load(NANOTRON_YAML)
    raw["data_stages"][0]["data"]["dataset"] = {"dataset_folder": ["/data/a", "/data/b"], "dataset_weights": [0.7, 0.3]}
    raw["data_stages"][1]["data"]["dataset"] = {"hf_dataset_or_datasets": {"json": 1, "/data/c": 0.5},
                                                "hf_data_files": "sft.jsonl"}
    text, report = convert(raw)
    stages = tomllib.loads(text)["data_stages"]
    assert stages[0]["data"]["dataset"] == {"dataset_folder": ["/data/a", "/data/b"], "dataset_weights": [0.7, 0.3]}
    assert stages[1]["data"]["dataset"]["hf_dataset_or_datasets"] == {"json": 1.0, "/data/c": 0.5}
    assert not [key for key, _, _ in report.dropped if key.startswith("data_stages")]
    # Carried over as written, but nanoflow's table names its files in its keys: the report says to rewrite it.
    assert any(note.startswith("data_stages[1].data.dataset: a {name = weight} table") for note in report.notes)
    assert not any(note.startswith("data_stages[0]") for note in report.notes)


def test_legacy_layouts(tmp_path):
    """Older nanotron: adam_* at the top of optimizer, and one `data` section instead of data_stages."""
    raw = yaml.safe_load(NANOTRON_YAML)
    factory = raw["optimizer"].pop("optimizer_factory")
    del factory["name"]
    raw["optimizer"].update(factory)
    raw["data"] = raw.pop("data_stages")[0]["data"]
    text, report = convert(raw)
    write_data(tmp_path)
    (tmp_path / "schedule.toml").write_text(text)
    config = load_config(tmp_path / "schedule.toml", ["parallelism.dp=1", "parallelism.tp=1"])
    assert config.optimizer.optimizer_factory.adam_eps == 1e-8 and config.optimizer.optimizer_factory.torch_adam_is_fused
    assert [(s.name, s.start_training_step) for s in config.data_stages] == [("stable", 1)]
    assert any("optimizer_factory" in n for n in report.notes) and any("stable" in n for n in report.notes)


def test_cli_writes_toml_to_stdout_and_report_to_stderr(tmp_path):
    (tmp_path / "config.yaml").write_text(NANOTRON_YAML)
    result = subprocess.run([sys.executable, "bin/convert-nanotron-config", str(tmp_path / "config.yaml")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout)["tokens"]["train_steps"] == 15
    assert f"{tmp_path / 'config.yaml'}: not carried over: parallelism.pp = 2" in result.stderr
    (tmp_path / "bad.yaml").write_text("a: [b\n")
    result = subprocess.run([sys.executable, "bin/convert-nanotron-config", str(tmp_path / "bad.yaml")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "error:" in result.stderr and not result.stdout


scalars = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=20))
keys = st.text(min_size=1, max_size=10)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(keys, st.one_of(scalars, st.lists(scalars, max_size=3),
                                       st.dictionaries(keys, scalars, max_size=3),
                                       st.lists(st.dictionaries(keys, scalars, min_size=1, max_size=3),
                                                min_size=1, max_size=2)), max_size=5))
def test_toml_emitter_round_trips(data):
    assert tomllib.loads(to_toml(data)) == data


def test_toml_emitter_writes_readable_tables():
    text = to_toml({"a": 1, "t": {"x": "q\"uote\n", "sub": {"y": 1.0}}, "arr": [{"n": "s1", "d": {"k": [1, 2]}}],
                    "ds": {"hf_dataset_or_datasets": {"a b": 0.5}}})
    assert text == textwrap.dedent('''\
        a = 1

        [t]
        x = "q\\"uote\\n"

        [t.sub]
        y = 1.0

        [[arr]]
        n = "s1"

        [arr.d]
        k = [1, 2]

        [ds]
        hf_dataset_or_datasets = {"a b" = 0.5}
        ''')
