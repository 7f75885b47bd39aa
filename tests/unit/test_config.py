"""load_config: a table of validation rules, each row checking that the message names the culprit."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from helpers import REPO

from nanoflow.config import Config, ConfigError, converter, load_config, unreached_stages
from nanoflow.schedule import Schedule

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
# One row per validation rule: the template with one change (or --set overrides) → a ConfigError naming
# the file (config_error checks that) and every fragment of `named`, and none of `not_named`.

def edit(old: str, new: str):
    return lambda text: replace(text, old, new)


def without_stages(text: str) -> str:
    return text[: text.index("[[data_stages]]")]


# id, change of the template, --set overrides, fragments the message names, fragments it must not name
RULES = [
    # structure
    ("unknown key suggests the nearest", edit("train_steps = 12", "trian_steps = 12"), [],
     ["trian_steps", "did you mean 'train_steps'", "tokens"], []),
    ("unknown key in a stage's dataset names the stage",
     edit('completion_column_name = "completion"\n', 'completion_column_name = "completion"\nbogus_option = 1\n'), [],
     ["bogus_option", "sft", "dataset"], []),
    ("a string for an int", edit("micro_batch_size = 2", 'micro_batch_size = "2"'), [],
     ["tokens.micro_batch_size", "int"], []),
    ("no stages: an empty list", lambda text: replace(without_stages(text), "[general]", "data_stages = []\n\n[general]"),
     [], ["data_stages", "no stages"], []),
    ("no stages: no table", without_stages, [], ["data_stages"], []),
    # the schedule
    ("two stages of one name", edit('name = "sft"', 'name = "pretrain"'), [], ['"pretrain"', "name", "data_stages["], []),
    ("two stages at one step", edit("start_training_step = 8", "start_training_step = 1"), [],
     ["start_training_step", "sft", "pretrain"], []),
    ("the first stage not at step 1", edit("start_training_step = 1", "start_training_step = 2"), [],
     ["pretrain", "start_training_step", "step 1"], []),
    ("a start step below 1", edit("start_training_step = 1", "start_training_step = 0"), [],
     ["pretrain", "start_training_step"], []),
    ("micro_batch_size 0", edit("micro_batch_size = 2", "micro_batch_size = 0"), [],
     ["tokens", "micro_batch_size", "> 0"], []),
    ("a stage's sequence_length 0", edit("sequence_length = 24", "sequence_length = 0"), [], ["sft", "sequence_length"], []),
    ("a stage's sequence_length above max_position_embeddings", edit("sequence_length = 24", "sequence_length = 65"), [],
     ["sft", "sequence_length = 65", "max_position_embeddings"], []),
    ("tokens.sequence_length above max_position_embeddings", edit("sequence_length = 32", "sequence_length = 128"), [],
     ["tokens", "max_position_embeddings"], []),
    # model and parallelism
    ("heads not divisible by kv heads", edit("num_key_value_heads = 2", "num_key_value_heads = 3"), [],
     ["num_attention_heads", "num_key_value_heads"], []),
    ("heads not divisible by tp", edit("tp = 1", "tp = 3"), [], ["num_attention_heads", "parallelism.tp"], []),
    ("global_batch_size off", edit("batch_accumulation_per_replica = 2",
                                   "batch_accumulation_per_replica = 2\nglobal_batch_size = 5"), [],
     ["global_batch_size = 5", "pretrain", "micro_batch_size"], []),
    ("a stage's global_batch_size off", edit("micro_batch_size = 4", "micro_batch_size = 4\nglobal_batch_size = 4"), [],
     ["sft", "global_batch_size = 4"], ["pretrain"]),
    # files
    ("a data pattern matching nothing", edit('"corpus/*.txt"', '"corpus/*.missing"'), [],
     ["pretrain", "hf_data_files", "corpus/*.missing"], []),
    ("a missing tokenizer file", edit('tokenizer_name_or_path = "bytes"', 'tokenizer_name_or_path = "tok/tokenizer.json"'),
     [], ["tokenizer.tokenizer_name_or_path", "tokenizer.json"], []),
    ("an SFT stage with only a prompt column", edit('completion_column_name = "completion"\n', ""), [],
     ["sft", "prompt_column_name", "completion_column_name"], []),
    # --set
    ("a misspelt --set key", lambda text: text, ["tokens.trian_steps=10"], ["did you mean 'train_steps'"], []),
    ("a --set value of the wrong type", lambda text: text, ["tokens.train_steps=ten"], ["tokens.train_steps"], []),
]


@pytest.mark.parametrize("change, overrides, named, not_named", [row[1:] for row in RULES], ids=[row[0] for row in RULES])
def test_each_rule_names_its_culprit(tmp_path, change, overrides, named, not_named):
    message = config_error(tmp_path, change(VALID), overrides)
    for fragment in named:
        assert fragment in message, (fragment, message)
    for fragment in not_named:
        assert fragment not in message, (fragment, message)


# ---------------------------------------------------------------------------------------------
# Rules that take more than one row


def test_sequence_parallel_needs_every_stage_length_divisible_by_tp(tmp_path):
    odd = replace(replace(VALID, "tp = 1", "tp = 2"), "sequence_length = 24", "sequence_length = 25")
    load_config(write_config(tmp_path, odd))                       # all-reduce tensor parallelism: any length
    message = config_error(tmp_path, replace(odd, "tp = 2", 'tp = 2\ntp_mode = "REDUCE_SCATTER"'))
    assert 'stage "sft"' in message and "sequence_length = 25 is not divisible by parallelism.tp = 2" in message
    assert 'stage "pretrain"' not in message                       # 32 splits in two


def test_dp_times_tp_differs_from_world_size(tmp_path, monkeypatch):
    """Checked once, where the processes join (init_topology), before anything is read or written."""
    from nanoflow.parallel.mesh import init_topology

    config = load_config(write_config(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError) as info:
        init_topology(config)
    message = str(info.value)
    assert "parallelism.dp" in message and "parallelism.tp" in message
    assert "4" in message
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match=r"= 2 processes, but launch with torchrun --nproc_per_node=2"):
        init_topology(load_config(write_config(tmp_path, replace(VALID, "dp = 1", "dp = 2"))))


def test_world_size_matching_dp_times_tp_is_fine(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = load_config(write_config(tmp_path, replace(VALID, "dp = 1", "dp = 2")))
    assert config.parallelism.dp == 2


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")


def test_invalid_toml(tmp_path):
    path = write_config(tmp_path, VALID + "\n[broken\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_data_stages_written_as_a_table_is_a_config_error(tmp_path):
    # [data_stages.data] without [[data_stages]]: a table where an array of stages belongs, once a traceback (exit 1)
    stages = VALID.index("[[data_stages]]")
    path = write_config(tmp_path, VALID[:stages] + '[data_stages.data.dataset]\nhf_dataset_or_datasets = "text"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "data_stages" in str(info.value)


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


def test_a_missing_key_is_named_with_what_to_add(tmp_path):
    path = write_config(tmp_path)
    text = path.read_text()
    start = text.index("[data_stages.data.dataset]", text.index('name = "sft"'))
    end = text.find("[[", start)
    path.write_text(text[:start] + (text[end:] if end != -1 else ""))   # the sft stage without its data
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert 'data_stages[1] (stage "sft").data: required key missing: add the table [data_stages.data.dataset] ' \
           'with hf_dataset_or_datasets = "text"' in str(info.value)


@pytest.mark.parametrize("text, expected", [
    # a stage written as one table: each [[data_stages]] entry, two brackets
    ('[tokens]\ntrain_steps = 10\n[data_stages.data]\nseed = 1\n',
     "data_stages: a table, but it is an array of tables: write [[data_stages]] (two brackets) once per entry"),
    ('data_stages = ["pretrain"]\n', "data_stages[0]: a string, but each entry is a table: write [[data_stages]]"),
    ('[[tokens]]\ntrain_steps = 1\n', "tokens: an array, but it is a table: write [tokens] and its keys below it"),
    ('[[data_stages]]\nname = "a"\nstart_training_step = 1\ndata = 3\n',
     "data_stages[0].data: a number, but it is a table: write [data_stages.data]"),
])
def test_a_value_where_a_table_belongs_is_named_with_what_to_write(tmp_path, text, expected):
    path = tmp_path / "shape.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert expected in str(info.value) and "attribute" not in str(info.value), str(info.value)


def test_missing_stages_are_asked_for_as_an_array_of_tables(tmp_path):
    path = tmp_path / "no_stages.toml"
    path.write_text("[tokens]\ntrain_steps = 10\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert ('data_stages: required key missing: add a [[data_stages]] table for each entry, with name = "sft" and '
            "start_training_step = 1 and a [data_stages.data] table") in str(info.value), str(info.value)


def test_an_unknown_eval_set_in_set_is_called_an_eval_set(tmp_path):
    path = REPO / "schedules" / "curriculum.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=["evaluation.datasets.sums.max_samples=200"])
    assert "has no eval set 'sums' (eval sets: prose, glossary, reverse)" in str(info.value)
    with pytest.raises(ConfigError, match="has no stage 'nope' \\(stages: pretrain, anneal, sft\\)"):
        load_config(path, overrides=["data_stages.nope.sequence_length=16"])


# ---------------------------------------------------------------------------------------------
# Inputs at the edges: one ConfigError line each, never a traceback (issue 30, item 14)

LONG = "a" * 300   # a path component longer than any file system's file names (255 bytes)


@pytest.mark.parametrize("key, value", [
    ("data_stages.pretrain.data.dataset.hf_dataset_or_datasets", f"corpus/{LONG}"),
    ("data_stages.pretrain.data.dataset.hf_dataset_or_datasets", f"{LONG}.txt"),
    ("data_stages.pretrain.data.dataset.hf_dataset_or_datasets", LONG),
    ("data_stages.pretrain.data.dataset.hf_data_files", f"corpus/{LONG}/*.txt"),
    ("data_stages.sft.data.dataset.hf_data_files", f"{LONG}.jsonl"),
])
def test_a_dataset_path_component_too_long_for_a_file_name_is_a_config_error_naming_the_key(tmp_path, key, value):
    path = write_config(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=[f'{key}="{value}"'])
    message = str(info.value)
    assert str(path) in message and key.rpartition(".")[2] in message, message
    assert re.search(r"a path component of 30\d bytes, longer than a file name can be \(255 bytes at most\)",
                     message), message


def test_a_token_folder_path_component_too_long_is_a_config_error(tmp_path):
    path = write_config(tmp_path, replace(VALID, 'hf_dataset_or_datasets = "text"\nhf_data_files = ["corpus/*.txt"]',
                                          f'dataset_folder = "tokens/{LONG}"'))
    with pytest.raises(ConfigError, match=r"dataset_folder: .*a path component of 300 bytes"):
        load_config(path)


def test_set_addressing_a_stage_by_name_in_an_array_that_is_not_of_tables_is_a_config_error(tmp_path):
    path = write_config(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=['data_stages=["a"]', "data_stages.sft.sequence_length=16"])
    message = str(info.value)
    assert "data_stages.sft.sequence_length=16" in message and "not an array of tables" in message, message
    with pytest.raises(ConfigError, match="not an array of tables"):
        load_config(path, overrides=["tokens=[1, 2]", "tokens.0.train_steps=3"])


@pytest.mark.parametrize("override, expected", [
    ("general.seed=" + "9" * 5001, "5,001 digits"),
    ("general.seed=" + "[" * 5000 + "]" * 5000, "nested too deeply"),
])
def test_a_set_value_python_cannot_read_is_a_config_error(tmp_path, override, expected):
    path = write_config(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=[override])
    message = str(info.value)
    assert expected in message and len(message) < 400, message


def test_an_integer_too_long_for_python_in_the_file_is_a_config_error(tmp_path):
    path = write_config(tmp_path, replace(VALID, "seed = 7", "seed = " + "9" * 5001))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "5,001 digits" in str(info.value) and "line 3" in str(info.value)
