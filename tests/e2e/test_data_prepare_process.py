"""bin/prepare with several processes, and bin/train on bad prepared data (tests/unit/test_data_prepare.py: in-process)."""

import json
import os

import pytest

from process_helpers import run_command, train_args
from support.data_prepare import inputs
from nanoflow.data.prepare import prepare


@pytest.mark.slow
def test_bin_prepare_with_several_processes_writes_the_same_folder(tmp_path, inputs):
    files, jsonl = inputs
    prepare([*files, jsonl], str(tmp_path / "one"), text_column="content", docs_per_shard=2, num_proc=1)
    result = run_command("prepare", *files, jsonl, "--output", tmp_path / "two", "--text-column", "content",
                         "--num-proc", "2", "--docs-per-shard", "2", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "16 documents" in result.stdout and "8 files" in result.stdout and "verified" in result.stdout
    for name in sorted(os.listdir(tmp_path / "one")):
        if name != "prepare.json":
            assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    bad = run_command("prepare", jsonl, "--output", str(tmp_path / "three"), timeout=300)
    assert bad.returncode == 2 and 'no column "text"' in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_bin_train_reports_a_truncated_token_file_before_step_1(blend_folders, tmp_path):
    import shutil

    broken = tmp_path / "code"
    shutil.copytree(blend_folders / "code", broken)
    with open(broken / "00000.ds", "ab") as f:
        f.write(b"\x01")                                  # half a token
    folders = json.dumps([str(broken), str(blend_folders / "prose")])
    result = run_command("train", *train_args(tmp_path / "run", f"data_stages.pretrain.data.dataset.dataset_folder={folders}",
                                              config="schedules/blend.toml"), timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f'stage "pretrain" (dataset_folder {broken}): {broken}/00000.ds: ' in result.stderr
    assert "is not a whole number of 2-byte tokens; the file is truncated" in result.stderr
    assert not (tmp_path / "run" / "1").exists()


@pytest.mark.slow
def test_bad_data_in_a_later_stage_stops_the_run_before_step_1(blend_folders, tmp_path):
    folders = json.dumps([str(blend_folders / "code"), str(blend_folders / "prose")])
    result = run_command("train", *train_args(tmp_path / "run", f"data_stages.pretrain.data.dataset.dataset_folder={folders}",
                                              'data_stages.sft.data.dataset.prompt_column_name="question"',  # no such column
                                              config="schedules/blend.toml"), timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert 'stage "sft"' in result.stderr and "question" in result.stderr, result.stderr
    assert "step 1/" not in result.stdout and not (tmp_path / "run" / "metrics.jsonl").exists()
