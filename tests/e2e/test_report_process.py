"""bin/report as a command (tests/unit/test_report.py: the report in-process)."""

from __future__ import annotations

import pytest

from process_helpers import run_command
from support.report import png_size
from nanoflow.commands.report import HEIGHT, WIDTH


@pytest.mark.slow
def test_cli_report(run, tmp_path):
    result = run_command("report", str(run), "--out", str(tmp_path / "r.png"), timeout=120)
    assert result.returncode == 0, result.stderr
    assert png_size(tmp_path / "r.png") == (WIDTH, HEIGHT)
    assert "pretrain" in result.stdout and "total: 10 steps" in result.stdout
    result = run_command("report", str(tmp_path / "none"), timeout=120)
    assert result.returncode == 2 and "no such file" in result.stderr
