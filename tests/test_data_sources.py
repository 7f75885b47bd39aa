"""What a stage's data is: which sources exist (one definition for the check before the run and for the loader),
which split of a split list is trained on, how much a source holds out, and where its tokens are cached."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_helpers import BYTES, documents, load, stage, write_folder
from nanoflow.config import ConfigError
from nanoflow.data import open_stage
from nanoflow.data.tokens import DataInputError


# ---------------------------------------------------------------------------------------------
# held_out_samples at least the source's samples (issue 21, item 12)

def test_held_out_samples_of_the_whole_source_names_the_stage_the_source_and_both_numbers(tmp_path):
    (tmp_path / "corpus.txt").write_text("some words of prose " * 10)        # 200 bytes: 12 windows of 16
    config = load(tmp_path, [stage("pretrain", 1, {"hf_dataset_or_datasets": "text", "hf_data_files": "corpus.txt",
                                                   "held_out_samples": 12})])
    with pytest.raises(DataInputError, match=r'stage "pretrain" \(text files .*corpus.txt\): held_out_samples = 12 '
                                             r"leaves nothing to train on: the source has 12 samples"):
        open_stage(config, 0, BYTES, cache_dir=str(tmp_path / "cache"))
    write_folder(tmp_path / "tokens", documents(np.random.default_rng(0), 4, 0, 200, (20, 21)))   # 84 tokens: 5
    config = load(tmp_path, [stage("pretrain", 1, {"dataset_folder": str(tmp_path / "tokens"),
                                                   "held_out_samples": 9})])
    with pytest.raises(DataInputError, match=r'stage "pretrain" \(dataset_folder .*tokens\): held_out_samples = 9 '
                                             r"leaves nothing to train on: the source has 5 samples"):
        open_stage(config, 0, BYTES)
