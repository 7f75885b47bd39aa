"""What test_data_sources.py and its process-level tests share."""

from __future__ import annotations

import json

import pytest
from data_helpers import load, stage

# ---------------------------------------------------------------------------------------------
# held_out_samples at least the source's samples (issue 21, item 12)


@pytest.fixture
def rows(tmp_path):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": f"row {i} " * 30}) + "\n" for i in range(600)))
    return load(tmp_path, [stage("pretrain", 1, {"hf_dataset_or_datasets": "json", "hf_data_files": "rows.jsonl"})])
