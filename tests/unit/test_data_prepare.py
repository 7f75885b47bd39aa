"""bin/prepare: round trip, resume after a crash, verification (schedules/blend.toml trained on its output:
tests/e2e/test_data_prepare_runs.py)."""

import io as text_io
import json
import os
from pathlib import Path

import pytest
from helpers import REPO
from process_helpers import run_in_process, train_args

import nanoflow.data.prepare as prepare_module
from nanoflow.config import DatasetArgs
from nanoflow.data import TokenFolder, load_tokenizer
from nanoflow.data.hf_datasets import hf_specs, load_rows, tokenize_rows
from nanoflow.data.prepare import PrepareError, prepare


def direct_stream(files, jsonl, tokenizer, cache) -> list[int]:
    """The same inputs through nanoflow's HF sources: documents + end-of-text, in order."""
    text = DatasetArgs("text", hf_data_files=files)
    rows = DatasetArgs("json", hf_data_files=jsonl, text_column_name="content")
    stream = []
    for dataset, column in ((text, "text"), (rows, "content")):
        loaded = load_rows(hf_specs(dataset)[0], "direct", cache)
        stream += tokenize_rows(loaded, "packed", (column,), tokenizer).tolist()
    return stream


@pytest.mark.parametrize("tokenizer", ["bytes", "tokenizer.json"])
def test_prepare_then_read_back_equals_tokenizing_directly(tmp_path, inputs, tokenizer):
    files, jsonl = inputs
    if tokenizer != "bytes":
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator([Path(f).read_text() for f in files],
                                trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
        (tmp_path / "wordlevel").mkdir()
        tokenizer = str(tmp_path / "wordlevel" / "tokenizer.json")
        tok.save(tokenizer)
    out = text_io.StringIO()
    summary = prepare([*files, jsonl], str(tmp_path / "tokens"), tokenizer=tokenizer, text_column="content",
                      docs_per_shard=4, num_proc=1, out=out, cache_dir=str(tmp_path / "cache"))
    assert summary["documents"] == 16 and summary["files"] == 4 and summary["resumed"] == 0
    folder = TokenFolder(tmp_path / "tokens")
    expected = direct_stream(files, jsonl, load_tokenizer(tokenizer), str(tmp_path / "cache"))
    assert folder[0:len(folder)].tolist() == expected
    # The tokenizer as datatrove records a local one: its path (absolute here, so it resolves from anywhere).
    assert folder.tokenizer_name == ("bytes" if tokenizer == "bytes" else tokenizer) and folder.token_size == 2
    assert [f.documents for f in folder.files] == [4, 4, 4, 4]
    manifest = json.loads((tmp_path / "tokens" / "prepare.json").read_text())
    assert manifest["complete"] and sorted(manifest["shards"]) == ["00000", "00001", "00002", "00003"]


def test_a_killed_prepare_resumes_and_ends_identical(tmp_path, inputs, monkeypatch):
    files, jsonl = inputs
    straight = tmp_path / "straight"
    prepare([*files, jsonl], str(straight), text_column="content", docs_per_shard=3, num_proc=1)

    real, calls = prepare_module._prepare_shard, []

    def dies_on_the_third(*args):
        calls.append(args[-1])
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(*args)

    monkeypatch.setattr(prepare_module, "_prepare_shard", dies_on_the_third)
    crashed = tmp_path / "crashed"
    with pytest.raises(KeyboardInterrupt):
        prepare([*files, jsonl], str(crashed), text_column="content", docs_per_shard=3, num_proc=1)
    assert not json.loads((crashed / "prepare.json").read_text())["complete"]
    monkeypatch.setattr(prepare_module, "_prepare_shard", real)
    summary = prepare([*files, jsonl], str(crashed), text_column="content", docs_per_shard=3, num_proc=1)
    assert summary["resumed"] == 2 and summary["files"] == 6
    for name in sorted(os.listdir(straight)):
        if name != "prepare.json":
            assert (crashed / name).read_bytes() == (straight / name).read_bytes(), name
    assert not [n for n in os.listdir(crashed) if ".tmp-" in n]


def test_prepare_refuses_a_folder_of_another_preparation_and_catches_damage(tmp_path, inputs):
    files, jsonl = inputs
    out = str(tmp_path / "tokens")
    prepare(files, out, docs_per_shard=3, num_proc=1)
    with pytest.raises(PrepareError, match=r"holds another preparation \(it differs in inputs, documents\)"):
        prepare(files[:-1], out, docs_per_shard=3, num_proc=1)
    shard = tmp_path / "tokens" / "00001.ds"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))               # same size: only the read-back checksum can tell
    with pytest.raises(PrepareError, match=r"verification: .*00001\.ds does not read back as written"):
        prepare(files, out, docs_per_shard=3, num_proc=1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.ds").write_bytes(b"")
    with pytest.raises(PrepareError, match="already holds token files that bin/prepare did not record"):
        prepare(files, str(tmp_path / "other"), num_proc=1)


def test_prepare_names_a_missing_column_or_input(tmp_path, inputs):
    files, jsonl = inputs
    with pytest.raises(PrepareError, match=r'rows.jsonl: no column "text"; the columns are content, id '
                                           r"\(choose one with --text-column\)"):
        prepare([jsonl], str(tmp_path / "a"), num_proc=1)
    with pytest.raises(PrepareError, match=r"in/\*\.md: matches no file"):
        prepare([str(tmp_path / "in" / "*.md")], str(tmp_path / "b"), num_proc=1)


# ---------------------------------------------------------------------------------------------
# schedules/blend.toml: a blended token-folder stage, an HF stage and an SFT stage


@pytest.mark.slow
def test_bin_train_reports_a_truncated_token_file_before_step_1(blend_folders, tmp_path, capsys):
    import shutil

    broken = tmp_path / "code"
    shutil.copytree(blend_folders / "code", broken)
    with open(broken / "00000.ds", "ab") as f:
        f.write(b"\x01")                                  # half a token
    folders = json.dumps([str(broken), str(blend_folders / "prose")])
    result = run_in_process("train", *train_args(tmp_path / "run", f"data_stages.pretrain.data.dataset.dataset_folder={folders}",
                                                 config=REPO / "schedules" / "blend.toml"), capsys=capsys)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f'stage "pretrain" (dataset_folder {broken}): {broken}/00000.ds: ' in result.stderr
    assert "is not a whole number of 2-byte tokens; the file is truncated" in result.stderr
    assert not (tmp_path / "run" / "1").exists()


@pytest.mark.slow
def test_bad_data_in_a_later_stage_stops_the_run_before_step_1(blend_folders, tmp_path, capsys):
    folders = json.dumps([str(blend_folders / "code"), str(blend_folders / "prose")])
    result = run_in_process("train", *train_args(tmp_path / "run", f"data_stages.pretrain.data.dataset.dataset_folder={folders}",
                                                 'data_stages.sft.data.dataset.prompt_column_name="question"',  # no such column
                                                 config=REPO / "schedules" / "blend.toml"), capsys=capsys)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert 'stage "sft"' in result.stderr and "question" in result.stderr, result.stderr
    assert "step 1/" not in result.stdout and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_help_of_bin_prepare_gives_the_default_shard_size_the_code_uses(capsys):
    # The help is built without importing nanoflow.data.prepare (bin/* answer before torch loads), so it spells the
    # default out: this holds the two together.
    from nanoflow.commands import cli

    with pytest.raises(SystemExit):
        cli.prepare_main(["--help"])
    assert f"(default {prepare_module.DOCS_PER_SHARD})" in " ".join(capsys.readouterr().out.split())


def test_a_compressed_jsonl_input_is_prepared_row_by_row(tmp_path, inputs):
    import gzip

    _, jsonl = inputs
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(Path(jsonl).read_bytes()))
    summary = prepare([str(tmp_path / "rows.jsonl.gz")], str(tmp_path / "tokens"), text_column="content", num_proc=1,
                      cache_dir=str(tmp_path / "cache"))
    plain = prepare([jsonl], str(tmp_path / "plain"), text_column="content", num_proc=1, cache_dir=str(tmp_path / "cache"))
    assert summary["documents"] == plain["documents"] == 9                  # its rows, not one raw document
    assert (tmp_path / "tokens" / "00000.ds").read_bytes() == (tmp_path / "plain" / "00000.ds").read_bytes()


def test_an_archive_input_is_refused_by_name(tmp_path):
    (tmp_path / "docs.tar.gz").write_bytes(b"not read")
    with pytest.raises(PrepareError, match=r"docs\.tar\.gz is an archive \(\.tar\.gz\): extract it"):
        prepare([str(tmp_path / "docs.tar.gz")], str(tmp_path / "tokens"), cache_dir=str(tmp_path / "cache"))
