"""bin/train --plan opens every source far enough to find what the run would stop on at start-up (issue 30 item 13),
without tokenizing; tests/e2e/test_errors.py runs it as a process (hub names offline, unreadable files)."""

from __future__ import annotations

import json

import numpy as np
from data_helpers import documents, stage, write_config, write_folder
from process_helpers import run_in_process


def sums(tmp_path):
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps({"question": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                                                 for a in range(40)))
    return str(tmp_path / "sums.jsonl")


def plan(tmp_path, stages, capsys, *extra):
    return run_in_process("train", write_config(tmp_path, stages, train_steps=8), "--plan", *extra, capsys=capsys)


def test_a_prompt_column_the_file_lacks_stops_the_plan_naming_stage_file_and_column(tmp_path, capsys):
    sft = stage("sft", 1, {"hf_dataset_or_datasets": "json", "hf_data_files": sums(tmp_path),
                           "prompt_column_name": "prompt", "completion_column_name": "answer"})
    result = plan(tmp_path, [sft], capsys)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f'stage "sft" (json files {tmp_path / "sums.jsonl"}): no column "prompt"; the columns are question, answer' \
        in result.stderr, result.stderr
    assert result.stdout == ""


def test_a_stage_not_reached_is_not_opened_but_an_eval_set_is(tmp_path, capsys):
    good = stage("pretrain", 1, {"hf_dataset_or_datasets": "json", "hf_data_files": sums(tmp_path),
                                 "text_column_name": "question"})
    later = stage("later", 100, {"hf_dataset_or_datasets": "json", "hf_data_files": sums(tmp_path),
                                 "text_column_name": "nope"})
    assert plan(tmp_path, [good, later], capsys).returncode == 0   # after train_steps: the run never opens it
    path = write_config(tmp_path, [good], train_steps=8)
    path.write_text(path.read_text() + f"""
[[evaluation.datasets]]
name = "held"
[evaluation.datasets.dataset]
hf_dataset_or_datasets = "json"
hf_data_files = {json.dumps(sums(tmp_path))}
text_column_name = "text"
""")
    result = run_in_process("train", path, "--plan", capsys=capsys)
    assert result.returncode == 2, result.stderr
    assert 'stage "evaluation held" (json files' in result.stderr and 'no column "text"' in result.stderr


def test_every_problem_of_every_stage_in_one_error_and_a_line_per_source(tmp_path, capsys):
    bad = stage("a", 1, {"hf_dataset_or_datasets": {str(tmp_path / "sums.jsonl"): 1.0}, "text_column_name": "x"})
    tokens = tmp_path / "tokens"
    write_folder(tokens, documents(np.random.default_rng(0), 50, 0, 200), tokenizer_name="gpt2")
    other = stage("b", 4, {"dataset_folder": str(tokens)})
    sums(tmp_path)
    result = plan(tmp_path, [bad, other], capsys)
    assert result.returncode == 2, result.stderr
    assert "2 sources cannot be read as configured" in result.stderr
    assert 'no column "x"' in result.stderr and 'tokenized with "gpt2"' in result.stderr
    good = plan(tmp_path, [stage("a", 1, {"hf_dataset_or_datasets": {str(tmp_path / "sums.jsonl"): 1.0},
                                          "text_column_name": "question"})], capsys)
    assert good.returncode == 0, good.stderr
    assert good.stderr.splitlines() == [
        "--plan: opening the tokenizer and the data of 1 stage, as training would (a large source takes a while)",
        f'opening stage "a" (json files {tmp_path / "sums.jsonl"})']
