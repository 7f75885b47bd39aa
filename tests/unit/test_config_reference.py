"""docs/config.md is the schema's: every key carries its meaning on its field, the page is what the fields render,
and the keys marked as paths are the ones the loader resolves against the TOML file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import attrs
import pytest
from helpers import REPO

from nanoflow.config import Config, converter, schema, stages
from nanoflow.config.load import resolve_paths
from nanoflow.config.reference import fields, render

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PAGE = REPO / "docs" / "config.md"


def schema_classes() -> set[type]:
    return {value for module in (schema, stages) for value in vars(module).values()
            if isinstance(value, type) and attrs.has(value) and value.__module__ == module.__name__}


def test_every_key_has_a_meaning():
    listed = fields()
    assert len(listed) >= 115   # the schema's keys when the reference was written; a new one only adds rows
    missing = [path for path, f in listed if not str(f.metadata.get("doc", "")).strip()]
    assert not missing, f"keys without a meaning (declare them with schema.key(doc, ...)): {missing}"
    one_line = [path for path, f in listed if "\n" in f.metadata["doc"]]
    assert not one_line, f"meanings of more than one line: {one_line}"


def test_the_reference_reaches_every_schema_class():
    reached = {cls for cls in schema_classes() for _, f in fields() if f in attrs.fields(cls)}
    assert reached == schema_classes()


def test_docs_config_md_is_what_the_schema_renders():
    assert PAGE.read_text() == render(), (
        "docs/config.md differs from the schema: run `python -m nanoflow.config.reference > docs/config.md`")


def test_every_key_path_is_on_the_page():
    text = PAGE.read_text()
    absent = [path for path, _ in fields() if f"| `{path}` |" not in text]
    assert not absent, absent
    assert "| `tokens.train_steps` | integer | required |" in text
    assert "| `data_stages[].data.dataset.hf_data_files` | path or list of paths | unset |" in text
    assert "| `checkpoints.checkpoint_interval` | integer | `1000` |" in text


# ---------------------------------------------------------------------------------------------
# Paths: marked on the field, resolved by one walk

MARKED = {
    ("ModelArgs", "init_from"), ("TokenizerArgs", "tokenizer_name_or_path"),
    ("CheckpointsArgs", "checkpoints_path"), ("CheckpointsArgs", "resume_checkpoint_path"),
    ("DatasetArgs", "hf_dataset_or_datasets"), ("DatasetArgs", "hf_data_files"), ("DatasetArgs", "dataset_weights_end"),
    ("NanosetDatasetsArgs", "dataset_folder"), ("WandbArgs", "dir"),
}

RELATIVE = """\
[model]
vocab_size = 288
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
init_from = "weights"

[tokenizer]
tokenizer_name_or_path = "tok/tokenizer.json"

[tokens]
sequence_length = 32
train_steps = 12
micro_batch_size = 2

[optimizer.learning_rate_scheduler]
learning_rate = 1e-2

[checkpoints]
checkpoints_path = "runs/new"
resume_checkpoint_path = "runs/old"

[logging.wandb]
project = "p"
dir = "wandb-files"

[[data_stages]]
name = "blend"
start_training_step = 1
[data_stages.data.dataset]
hf_dataset_or_datasets = {"corpus/a.txt" = 1.0, "corpus/b.txt" = 2.0}
dataset_weights_end = {"corpus/a.txt" = 0.0, "corpus/b.txt" = 1.0}

[[data_stages]]
name = "tokens"
start_training_step = 5
[data_stages.data.dataset]
dataset_folder = ["tokens/a", "tokens/b"]

[[data_stages]]
name = "sft"
start_training_step = 9
[data_stages.data.dataset]
hf_dataset_or_datasets = "json"
hf_data_files = ["sft.jsonl"]

[[evaluation.datasets]]
name = "held"
[evaluation.datasets.dataset]
hf_dataset_or_datasets = "json"
hf_data_files = "eval/held.jsonl"

[[evaluation.datasets]]
name = "folder"
[evaluation.datasets.dataset]
dataset_folder = "tokens/eval"
"""


def marked_values(value, found: list) -> list:
    """(class name, key, value) of every field marked as a path, anywhere in the config."""
    if attrs.has(type(value)):
        for f in attrs.fields(type(value)):
            item = getattr(value, f.name)
            if "path" in f.metadata:
                found.append((type(value).__name__, f.name, item))
            else:
                marked_values(item, found)
    elif isinstance(value, tuple):
        for item in value:
            marked_values(item, found)
    return found


def as_paths(value) -> list[str]:
    return list(value) if isinstance(value, (list, dict)) else [value]


def test_the_marked_keys_are_the_path_keys():
    marked = {(cls.__name__, f.name) for cls in schema_classes() for f in attrs.fields(cls) if "path" in f.metadata}
    assert marked == MARKED


def test_one_walk_resolves_every_marked_key_against_the_toml_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the working directory is not where relative paths start
    base = tmp_path / "project"
    config = resolve_paths(converter.structure(tomllib.loads(RELATIVE), Config), base)
    found = marked_values(config, [])
    assert {(cls, key) for cls, key, value in found if value is not None} == MARKED   # the sample has each one
    for cls, key, value in found:
        for path in as_paths(value) if value is not None else []:
            if path == "json":   # a builder's name, not a path
                continue
            assert os.path.isabs(path) and path.startswith(str(base) + os.sep), (cls, key, path)
    blend = config.data_stages[0].data.dataset
    assert blend.hf_dataset_or_datasets == {str(base / "corpus/a.txt"): 1.0, str(base / "corpus/b.txt"): 2.0}
    assert blend.dataset_weights_end == {str(base / "corpus/a.txt"): 0.0, str(base / "corpus/b.txt"): 1.0}
    assert config.evaluation.datasets[1].dataset.dataset_folder == str(base / "tokens" / "eval")
    assert config.data_stages[2].data.dataset.hf_dataset_or_datasets == "json"   # a builder stays a builder


@pytest.mark.parametrize("key, value", [
    ("tokenizer.tokenizer_name_or_path", "bytes"),
    ("checkpoints.checkpoints_path", "s3://bucket/runs/x"),
    ("checkpoints.checkpoints_path", "/already/absolute"),
    ("data_stages.0.data.dataset.hf_dataset_or_datasets", "org/name"),   # a hub id
])
def test_names_urls_and_absolute_paths_stay_as_written(key, value, tmp_path):
    raw = tomllib.loads(RELATIVE)
    node = raw
    *tables, last = key.split(".")
    for part in tables:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = value
    node.pop("dataset_weights_end", None)
    config = resolve_paths(converter.structure(raw, Config), tmp_path)
    node = config
    for part in key.split("."):
        node = node[int(part)] if isinstance(node, tuple) else getattr(node, part)
    assert node == value


def test_a_resolved_config_resolves_to_itself(tmp_path):
    config = resolve_paths(converter.structure(tomllib.loads(RELATIVE), Config), tmp_path)
    assert resolve_paths(config, Path("/elsewhere")) is config   # every path already absolute: nothing to change
