"""What test_fingerprint.py and its process-level tests share."""

import json

import pytest

from data_helpers import stage, write_config
from helpers import quiet
from nanoflow import load_config
from nanoflow.training.loop import train


@pytest.fixture
def run(tmp_path):
    """A run stopped after step 4 of 10: stage "pretrain" (text files) has begun, stage "sft" (step 7 on) has not."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in "ab":
        (corpus / f"{name}.txt").write_text(f"document {name} " * 200)
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(40)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = write_config(tmp_path, [
        stage("pretrain", 1, {"hf_dataset_or_datasets": "text", "hf_data_files": "corpus/*.txt"}),
        stage("sft", 7, {"hf_dataset_or_datasets": "json", "hf_data_files": "sft.jsonl",
                         "prompt_column_name": "prompt", "completion_column_name": "completion"}),
    ], train_steps=10)
    train(load_config(config, ["checkpoints.checkpoint_interval=2"]), until_step=4, out=quiet())
    return config
