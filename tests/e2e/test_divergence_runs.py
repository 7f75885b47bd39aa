"""A diverging run saves nothing and keeps its last good checkpoint (tests/unit/test_divergence.py: the config
and the step)."""

from __future__ import annotations

import hashlib
import io as text_io
from pathlib import Path

from helpers import TINY
from process_helpers import run_in_process

from nanoflow import io, load_config
from nanoflow.errors import EXIT_DIVERGED
from nanoflow.training.loop import train


def _checkpoint_files(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != "metrics.jsonl" and not p.name.startswith("events.")}


def test_a_diverging_run_saves_nothing_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    train(load_config(TINY, [f'checkpoints.checkpoints_path="{tmp_path}"']), until_step=4, out=text_io.StringIO())
    before = _checkpoint_files(tmp_path)
    assert "4/checkpoint_metadata.json" in before
    # Resumed with a huge LR: step 5 throws the weights out, step 6 is non-finite.
    sets = [a for o in (f'checkpoints.checkpoints_path="{tmp_path}"', "checkpoints.checkpoint_interval=1",
                        "optimizer.learning_rate_scheduler.learning_rate=1e30",
                        "checkpoints.ignore_lr_schedule_change=true") for a in ("--set", o)]  # the LR edit is the point
    result = run_in_process("train", TINY, *sets, capsys=capsys)
    assert result.returncode == EXIT_DIVERGED, result.stdout + result.stderr
    assert 'step 6 (stage "pretrain")' in result.stderr and "Traceback" not in result.stderr
    after = _checkpoint_files(tmp_path)
    assert set(after) - set(before) == {f for f in after if f.startswith("5/")}   # step 5 (finite) was saved
    assert {f: after[f] for f in before if f != "latest.txt"} == {f: before[f] for f in before if f != "latest.txt"}
    assert io.read_metadata(str(tmp_path))["step"] == 5 and not (tmp_path / "6").exists()
    steps = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 5 and "NaN" not in steps[-1]

