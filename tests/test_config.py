"""load_config: one test per validation rule, each checking that the message names the culprit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nanoflow.config import Config, ConfigError, converter, load_config, unreached_stages
from nanoflow.schedule import Schedule

REPO = Path(__file__).resolve().parent.parent

# Mirrors schedules/tiny.toml, but reads data files each test writes into its own tmp_path.
VALID = """\
[general]
run = "tiny"
seed = 7

[model]
vocab_size = 288
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 64
tie_word_embeddings = true

[tokenizer]
tokenizer_name_or_path = "bytes"

[parallelism]
dp = 1
tp = 1

[tokens]
sequence_length = 32
train_steps = 12
micro_batch_size = 2
batch_accumulation_per_replica = 2

[optimizer]
weight_decay = 0.1
[optimizer.learning_rate_scheduler]
learning_rate = 1e-2
lr_warmup_steps = 3
min_decay_lr = 1e-3

[checkpoints]
checkpoints_path = "runs/tiny"
checkpoint_interval = 4

[[data_stages]]
name = "pretrain"
start_training_step = 1
[data_stages.data.dataset]
hf_dataset_or_datasets = "text"
hf_data_files = ["corpus/*.txt"]

[[data_stages]]
name = "sft"
start_training_step = 8
sequence_length = 24
micro_batch_size = 4
[data_stages.data.dataset]
hf_dataset_or_datasets = "json"
hf_data_files = "sft.jsonl"
prompt_column_name = "prompt"
completion_column_name = "completion"
"""


@pytest.fixture(autouse=True)
def _no_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def write_data(root: Path) -> None:
    (root / "corpus").mkdir(parents=True, exist_ok=True)
    (root / "corpus" / "a.txt").write_text("the quick brown fox\n")
    (root / "corpus" / "b.txt").write_text("jumps over the lazy dog\n")
    (root / "sft.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+3=", "completion": "5"}\n')


def replace(text: str, old: str, new: str, count: int = 1) -> str:
    assert text.count(old) >= count, f"{old!r} not in the template"
    return text.replace(old, new, count)


def write_config(tmp_path: Path, text: str = VALID, name: str = "run.toml") -> Path:
    write_data(tmp_path)
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(tmp_path: Path, text: str, overrides=()) -> str:
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=list(overrides))
    message = str(info.value)
    assert str(path) in message, message
    return message


# ---------------------------------------------------------------------------------------------
# The valid template itself


def test_template_is_valid(tmp_path):
    config = load_config(write_config(tmp_path))
    assert [s.name for s in config.data_stages] == ["pretrain", "sft"]
    assert config.tokens.train_steps == 12
    assert config.data_stages[1].data.dataset.is_sft


# ---------------------------------------------------------------------------------------------
# Structure errors


def test_unknown_key_suggests_nearest(tmp_path):
    message = config_error(tmp_path, replace(VALID, "train_steps = 12", "trian_steps = 12"))
    assert "trian_steps" in message
    assert "did you mean 'train_steps'" in message
    assert "tokens" in message


def test_unknown_key_in_stage_dataset_names_stage(tmp_path):
    text = replace(VALID, 'completion_column_name = "completion"\n',
                   'completion_column_name = "completion"\nbogus_option = 1\n')
    message = config_error(tmp_path, text)
    assert "bogus_option" in message
    assert "sft" in message
    assert "dataset" in message


def test_wrong_type_string_for_int(tmp_path):
    message = config_error(tmp_path, replace(VALID, "micro_batch_size = 2", 'micro_batch_size = "2"'))
    assert "tokens.micro_batch_size" in message
    assert "int" in message


def test_no_stages_empty_list(tmp_path):
    text = VALID[: VALID.index("[[data_stages]]")]
    text = replace(text, "[general]", "data_stages = []\n\n[general]")
    message = config_error(tmp_path, text)
    assert "data_stages" in message
    assert "no stages" in message


def test_no_stages_missing_table(tmp_path):
    text = VALID[: VALID.index("[[data_stages]]")]
    message = config_error(tmp_path, text)
    assert "data_stages" in message


# ---------------------------------------------------------------------------------------------
# Schedule rules


def test_duplicate_stage_names(tmp_path):
    message = config_error(tmp_path, replace(VALID, 'name = "sft"', 'name = "pretrain"'))
    assert '"pretrain"' in message
    assert "name" in message
    assert "data_stages[" in message


def test_duplicate_start_steps(tmp_path):
    message = config_error(tmp_path, replace(VALID, "start_training_step = 8", "start_training_step = 1"))
    assert "start_training_step" in message
    assert "sft" in message and "pretrain" in message


def test_first_stage_not_at_step_one(tmp_path):
    message = config_error(tmp_path, replace(VALID, "start_training_step = 1", "start_training_step = 2"))
    assert "pretrain" in message
    assert "start_training_step" in message
    assert "step 1" in message


def test_start_step_below_one(tmp_path):
    message = config_error(tmp_path, replace(VALID, "start_training_step = 1", "start_training_step = 0"))
    assert "pretrain" in message
    assert "start_training_step" in message


def test_micro_batch_size_zero(tmp_path):
    message = config_error(tmp_path, replace(VALID, "micro_batch_size = 2", "micro_batch_size = 0"))
    assert "tokens" in message
    assert "micro_batch_size" in message
    assert "> 0" in message


def test_stage_sequence_length_zero(tmp_path):
    message = config_error(tmp_path, replace(VALID, "sequence_length = 24", "sequence_length = 0"))
    assert "sft" in message
    assert "sequence_length" in message


def test_stage_sequence_length_above_max_position_embeddings(tmp_path):
    message = config_error(tmp_path, replace(VALID, "sequence_length = 24", "sequence_length = 65"))
    assert "sft" in message
    assert "sequence_length = 65" in message
    assert "max_position_embeddings" in message


def test_tokens_sequence_length_above_max_position_embeddings(tmp_path):
    message = config_error(tmp_path, replace(VALID, "sequence_length = 32", "sequence_length = 128"))
    assert "tokens" in message
    assert "max_position_embeddings" in message


# ---------------------------------------------------------------------------------------------
# Model and parallelism rules


def test_heads_not_divisible_by_kv_heads(tmp_path):
    message = config_error(tmp_path, replace(VALID, "num_key_value_heads = 2", "num_key_value_heads = 3"))
    assert "num_attention_heads" in message
    assert "num_key_value_heads" in message


def test_heads_not_divisible_by_tp(tmp_path):
    message = config_error(tmp_path, replace(VALID, "tp = 1", "tp = 3"))
    assert "num_attention_heads" in message
    assert "parallelism.tp" in message


def test_sequence_parallel_needs_every_stage_length_divisible_by_tp(tmp_path):
    odd = replace(replace(VALID, "tp = 1", "tp = 2"), "sequence_length = 24", "sequence_length = 25")
    load_config(write_config(tmp_path, odd))                       # all-reduce tensor parallelism: any length
    message = config_error(tmp_path, replace(odd, "tp = 2", 'tp = 2\ntp_mode = "REDUCE_SCATTER"'))
    assert 'stage "sft"' in message and "sequence_length = 25 is not divisible by parallelism.tp = 2" in message
    assert 'stage "pretrain"' not in message                       # 32 splits in two


def test_global_batch_size_inconsistent(tmp_path):
    text = replace(VALID, "batch_accumulation_per_replica = 2",
                   "batch_accumulation_per_replica = 2\nglobal_batch_size = 5")
    message = config_error(tmp_path, text)
    assert "global_batch_size = 5" in message
    assert "pretrain" in message
    assert "micro_batch_size" in message


def test_stage_global_batch_size_inconsistent(tmp_path):
    text = replace(VALID, "micro_batch_size = 4", "micro_batch_size = 4\nglobal_batch_size = 4")
    message = config_error(tmp_path, text)
    assert "sft" in message
    assert "global_batch_size = 4" in message
    assert "pretrain" not in message


def test_dp_times_tp_differs_from_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    message = config_error(tmp_path, VALID)
    assert "parallelism.dp" in message and "parallelism.tp" in message
    assert "4" in message


def test_world_size_matching_dp_times_tp_is_fine(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = load_config(write_config(tmp_path, replace(VALID, "dp = 1", "dp = 2")))
    assert config.parallelism.dp == 2


# ---------------------------------------------------------------------------------------------
# Files


def test_data_pattern_matching_nothing(tmp_path):
    message = config_error(tmp_path, replace(VALID, '"corpus/*.txt"', '"corpus/*.missing"'))
    assert "pretrain" in message
    assert "hf_data_files" in message
    assert "corpus/*.missing" in message


def test_missing_tokenizer_file(tmp_path):
    message = config_error(tmp_path, replace(VALID, 'tokenizer_name_or_path = "bytes"',
                                             'tokenizer_name_or_path = "tok/tokenizer.json"'))
    assert "tokenizer.tokenizer_name_or_path" in message
    assert "tokenizer.json" in message


def test_sft_with_only_prompt_column(tmp_path):
    message = config_error(tmp_path, replace(VALID, 'completion_column_name = "completion"\n', ""))
    assert "sft" in message
    assert "prompt_column_name" in message and "completion_column_name" in message


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")


def test_invalid_toml(tmp_path):
    path = write_config(tmp_path, VALID + "\n[broken\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


# ---------------------------------------------------------------------------------------------
# Positive tests


@pytest.mark.parametrize("name", ["curriculum.toml", "tiny.toml"])
def test_shipped_schedules_load(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # paths are relative to the file, not the cwd
    config = load_config(REPO / "schedules" / name)
    schedule = Schedule.from_config(config)
    assert schedule.train_steps == config.tokens.train_steps
    assert unreached_stages(config) == []


def test_curriculum_shape():
    config = load_config(REPO / "schedules" / "curriculum.toml")
    assert [s.name for s in config.data_stages] == ["pretrain", "anneal", "sft"]
    schedule = Schedule.from_config(config)
    assert [(s.start_step, s.global_batch_size, s.sequence_length) for s in schedule.stages] == [
        (1, 16, 256), (151, 16, 256), (201, 64, 32)]


def test_paths_resolved_relative_to_toml(tmp_path, monkeypatch):
    root = tmp_path / "project"
    root.mkdir()
    path = write_config(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(os.path.relpath(path, elsewhere))
    pretrain, sft = (s.data.dataset for s in config.data_stages)
    assert pretrain.hf_data_files == [str(root / "corpus" / "*.txt")]
    assert sft.hf_data_files == str(root / "sft.jsonl")
    assert config.checkpoints.checkpoints_path == str(root / "runs" / "tiny")
    assert config.tokenizer.tokenizer_name_or_path == "bytes"


def test_tokenizer_file_resolved_relative_to_toml(tmp_path, monkeypatch):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    path = write_config(tmp_path, replace(VALID, 'tokenizer_name_or_path = "bytes"',
                                          'tokenizer_name_or_path = "tok/tokenizer.json"'))
    monkeypatch.chdir(tmp_path / "corpus")
    config = load_config(path)
    assert config.tokenizer.tokenizer_name_or_path == str(tmp_path / "tok" / "tokenizer.json")


# ---------------------------------------------------------------------------------------------
# --set overrides


def test_override_int_is_typed(tmp_path):
    config = load_config(write_config(tmp_path), overrides=["tokens.train_steps=10"])
    assert config.tokens.train_steps == 10
    assert type(config.tokens.train_steps) is int


def test_override_stage_by_name(tmp_path):
    config = load_config(write_config(tmp_path), overrides=["data_stages.sft.sequence_length=16"])
    assert config.data_stages[1].sequence_length == 16
    assert config.data_stages[0].sequence_length is None


def test_override_stage_by_index(tmp_path):
    config = load_config(write_config(tmp_path), overrides=["data_stages.1.sequence_length=16"])
    assert config.data_stages[1].sequence_length == 16
    config = load_config(write_config(tmp_path), overrides=["data_stages.0.sequence_length=16"])
    assert config.data_stages[0].sequence_length == 16
    assert config.data_stages[1].sequence_length == 24


def test_override_bare_string(tmp_path):
    config = load_config(write_config(tmp_path), overrides=["general.run=my-run"])
    assert config.general.run == "my-run"
    config = load_config(write_config(tmp_path), overrides=['general.run="quoted"'])
    assert config.general.run == "quoted"


def test_override_float_and_new_section_key(tmp_path):
    config = load_config(write_config(tmp_path), overrides=[
        "optimizer.learning_rate_scheduler.learning_rate=3e-4",
        "logging.iteration_step_info_interval=5",
    ])
    assert config.optimizer.learning_rate_scheduler.learning_rate == 3e-4
    assert config.logging.iteration_step_info_interval == 5


def test_override_misspelt_key(tmp_path):
    message = config_error(tmp_path, VALID, overrides=["tokens.trian_steps=10"])
    assert "did you mean 'train_steps'" in message


def test_override_unknown_stage(tmp_path):
    path = write_config(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=["data_stages.anneal.sequence_length=16"])
    message = str(info.value)
    assert "anneal" in message
    assert "pretrain" in message and "sft" in message


def test_override_without_equals(tmp_path):
    with pytest.raises(ConfigError):
        load_config(write_config(tmp_path), overrides=["tokens.train_steps"])


def test_override_type_checked(tmp_path):
    message = config_error(tmp_path, VALID, overrides=["tokens.train_steps=ten"])
    assert "tokens.train_steps" in message


# ---------------------------------------------------------------------------------------------
# Derived values


def test_stage_tokens_applies_overrides(tmp_path):
    config = load_config(write_config(tmp_path))
    pretrain, sft = config.stage_tokens(0), config.stage_tokens(1)
    assert (pretrain.sequence_length, pretrain.micro_batch_size, pretrain.batch_accumulation_per_replica) == (32, 2, 2)
    assert (sft.sequence_length, sft.micro_batch_size, sft.batch_accumulation_per_replica) == (24, 4, 2)
    assert sft.train_steps == pretrain.train_steps == 12
    assert config.tokens.sequence_length == 32  # the shared section is untouched


def test_schedule_from_config_global_batch(tmp_path):
    config = load_config(write_config(tmp_path, replace(VALID, "dp = 1", "dp = 2")))
    schedule = Schedule.from_config(config)
    assert [(s.name, s.start_step, s.global_batch_size, s.sequence_length) for s in schedule.stages] == [
        ("pretrain", 1, 2 * 2 * 2, 32), ("sft", 8, 4 * 2 * 2, 24)]
    assert schedule.train_steps == 12


def test_unreached_stage_loads_and_is_named(tmp_path):
    config = load_config(write_config(tmp_path, replace(VALID, "start_training_step = 8", "start_training_step = 100")))
    assert unreached_stages(config) == ["sft"]
    assert load_config(write_config(tmp_path)).data_stages[1].start_training_step == 8
    assert unreached_stages(load_config(write_config(tmp_path))) == []


def test_data_seed_defaults_to_general_seed(tmp_path):
    text = replace(VALID, "[data_stages.data.dataset]", "[data_stages.data]\nseed = 99\n[data_stages.data.dataset]")
    config = load_config(write_config(tmp_path, text))
    assert config.data_seed(0) == 99
    assert config.data_seed(1) == 7


@pytest.mark.parametrize("source", ["template", "curriculum.toml", "tiny.toml"])
def test_to_dict_round_trips(source, tmp_path):
    path = write_config(tmp_path) if source == "template" else REPO / "schedules" / source
    config = load_config(path)
    data = config.to_dict()
    assert not _contains_none(data)
    assert converter.structure(data, Config) == config


def _contains_none(value) -> bool:
    if value is None:
        return True
    if isinstance(value, dict):
        return any(_contains_none(v) for v in value.values())
    if isinstance(value, list):
        return any(_contains_none(v) for v in value)
    return False
