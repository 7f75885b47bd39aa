"""Numbers and files that cannot train: refused before step 1, naming the key, or the file and line."""

import json
from pathlib import Path

import pytest
from data_helpers import stage, write_config
from helpers import TINY
from process_helpers import run_in_process, train_args

from nanoflow import ConfigError, load_config
from nanoflow.data import ByteTokenizer, StageDataError, open_stage
from nanoflow.schedule import Schedule


@pytest.mark.parametrize("override, message", [
    ("optimizer.optimizer_factory.adam_eps=nan", "optimizer.optimizer_factory.adam_eps: expected a finite number"),
    ("optimizer.optimizer_factory.adam_eps=0.0", "'adam_eps' must be > 0"),
    ("optimizer.optimizer_factory.adam_beta1=1.5", "'adam_beta1' must be < 1: 1.5"),
    ("optimizer.optimizer_factory.adam_beta2=1.0", "'adam_beta2' must be < 1"),
    ("optimizer.optimizer_factory.adam_beta1=-0.1", "'adam_beta1' must be >= 0"),
    ("tokens.train_steps=36893488147419103232", "tokens.train_steps: 36893488147419103232 does not fit in a 64-bit"),
    ("general.seed=-9223372036854775809", "general.seed: -9223372036854775809 does not fit in a 64-bit"),
    ("model.vocab_size=1000000000000", "'vocab_size' must be <= 4294967296"),
    ("model.vocab_size=1e12", "model.vocab_size: expected int, got float"),
])
def test_bad_numbers_are_refused_at_load_naming_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, [override])
    assert message in str(error.value)


def test_bin_train_exits_2_on_a_bad_number_without_a_traceback(tmp_path, capsys):
    result = run_in_process("train", *train_args(tmp_path, "optimizer.optimizer_factory.adam_beta1=1.5"), capsys=capsys)
    assert result.returncode == 2 and "adam_beta1" in result.stderr and "Traceback" not in result.stderr


def sft_stage(tmp_path: Path, name: str, content: bytes):
    (tmp_path / name).write_bytes(content)
    config = load_config(write_config(tmp_path, [
        stage("pretrain", 1, {"hf_dataset_or_datasets": "json", "hf_data_files": name,
                              "prompt_column_name": "prompt", "completion_column_name": "completion"})]))
    return config, str(tmp_path / name)


def row(i: int) -> bytes:
    return (json.dumps({"prompt": f"{i}+{i}=", "completion": str(2 * i)}) + "\n").encode()


@pytest.mark.parametrize("content, message", [
    (b"", r"{path}: the file is empty"),
    (b"\n\n", r"{path}: the file is empty"),
    (row(1) + row(2) + b'{"prompt": "3+3=", "completion": \n' + row(4), r"{path}, line 3, column \d+: not valid JSON"),
    (row(1) + b"[1, 2]\n" + row(3), r"{path}, line 2: a JSON list, expected an object"),
    (row(1) + row(2) + b"\xff\xfe garbage\n", r"{path}, line 3: not UTF-8 text"),
], ids=["empty", "blank-lines", "broken-line", "not-an-object", "binary"])
def test_unreadable_jsonl_is_named_with_its_line(tmp_path, content, message):
    config, path = sft_stage(tmp_path, "rows.jsonl", content)
    with pytest.raises(StageDataError, match=message.format(path=path.replace(".", r"\."))):
        open_stage(config, 0, ByteTokenizer(), Schedule.from_config(config)).close()


def test_binary_garbage_as_a_text_file_is_named(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_bytes(b"plain text\nmore text\n" + bytes(range(128, 256)) * 20)
    config = load_config(write_config(tmp_path, [
        stage("pretrain", 1, {"hf_dataset_or_datasets": "text", "hf_data_files": "corpus.txt"})]))
    with pytest.raises(StageDataError, match=rf"{tmp_path}/corpus\.txt, line 3: not UTF-8 text"):
        open_stage(config, 0, ByteTokenizer(), Schedule.from_config(config)).close()
    result = run_in_process("train", tmp_path / "run.toml", capsys=capsys)
    assert result.returncode == 2, result.stderr
    assert "corpus.txt, line 3: not UTF-8 text" in result.stderr and "Traceback" not in result.stderr
