"""What test_data_prepare.py and its process-level tests share."""

import json
from pathlib import Path

import pytest
from helpers import REPO

from nanoflow.data.prepare import prepare


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "in").mkdir()
    texts = [f"document {i}: ünïcödé " + "the quick brown fox " * (i + 1) for i in range(7)]
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"{i:02d}.txt").write_text(text)
    with open(tmp_path / "in" / "rows.jsonl", "w") as f:
        for i in range(9):
            f.write(json.dumps({"content": f"row {i} " * (i + 2), "id": i}) + "\n")
    files = sorted(str(p) for p in (tmp_path / "in").glob("*.txt"))
    return files, str(tmp_path / "in" / "rows.jsonl")


def prepared_blend(root: Path) -> Path:
    """Two folders bin/prepare would write (the package's code, the project's prose) and a small SFT file, in
    `root`: what schedules/blend.toml trains on."""
    code = sorted(str(p) for p in (REPO / "nanoflow").glob("*.py"))
    prose = [str(REPO / "README.md"), str(REPO / "BENCHMARKS.md")]
    prepare(code, str(root / "code"), num_proc=1, cache_dir=str(root / "cache"))
    prepare(prose, str(root / "prose"), num_proc=1, cache_dir=str(root / "cache"))
    with open(root / "sft.jsonl", "w") as f:     # small, so that the SFT stage wraps around within its steps
        f.writelines(json.dumps({"prompt": f"{i}+{i}=", "completion": str(2 * i)}) + "\n" for i in range(10))
    return root
