"""What test_report.py and its process-level tests share."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest

from helpers import tiny
from nanoflow.training.loop import train


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """schedules/tiny.toml trained to step 10 of 12 (pretrain 1–7, sft 8–12): the last stage is cut short."""
    run = tmp_path_factory.mktemp("report") / "run"
    train(tiny(run), until_step=10, out=io.StringIO())
    return run
