"""What test_tokenizers.py and its process-level tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import eot_tokenizer


@pytest.fixture
def eot_json(tmp_path) -> Path:
    return eot_tokenizer(tmp_path / "eot" / "tokenizer.json")


def raw(path: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))
