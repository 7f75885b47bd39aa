"""examples/notebook.py runs as documented and its hand-stepped losses fall in every stage."""

import re
import subprocess
import sys

import pytest
from helpers import REPO

STEP_LINE = re.compile(r"^step\s+(\d+)\s+(\S+)\s+loss\s+([0-9.]+)", re.MULTILINE)


@pytest.mark.slow
def test_notebook_example_runs_and_losses_fall():
    result = subprocess.run([sys.executable, "examples/notebook.py"], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    steps = [(int(step), stage, float(loss)) for step, stage, loss in STEP_LINE.findall(result.stdout)]
    assert [s for s, _, _ in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 5, result.stdout
    by_stage: dict[str, list[float]] = {}
    for _, stage, loss in steps:
        by_stage.setdefault(stage, []).append(loss)
    assert list(by_stage) == ["pretrain", "sft"], result.stdout
    for stage, losses in by_stage.items():
        assert losses[-1] < losses[0], (stage, losses)
    assert "StaleStateError" in result.stdout
    assert "remaining_steps" in result.stdout and "active_stage" in result.stdout
