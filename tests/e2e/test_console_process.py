"""What bin/train prints on its stdout, seen from a real process (tests/unit/test_console.py tests the console
in-process)."""

from __future__ import annotations

import io as text_io

import pytest
from helpers import tiny
from process_helpers import run_command, train_args

from nanoflow.training.loop import train


@pytest.mark.slow
def test_a_checkpoint_skipped_by_io_is_one_warning_line_on_bin_train_stdout(tmp_path):
    run = tmp_path / "run"
    train(tiny(run, "checkpoints.checkpoint_interval=2"), until_step=4, out=text_io.StringIO())
    (run / "4" / "checkpoint_metadata.json").unlink()   # step 4 incomplete: io skips it for step 2, and says so
    result = run_command("train", *train_args(run, "tokens.train_steps=6"), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = [line for line in result.stdout.splitlines() if "is incomplete" in line]
    assert len(warnings) == 1, result.stdout
    assert warnings[0].startswith(f"warning: {run}: using {run}/2; skipped: {run}/4 is incomplete "
                                  "(no checkpoint_metadata.json)"), result.stdout
    assert f"resuming from {run}/2: step 2 done" in result.stdout
    assert "warning" not in result.stderr.lower(), result.stderr   # not twice, not as a Python warning on stderr
