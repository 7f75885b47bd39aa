"""bin/train --until-step N (--stop-at N): stop and save after step N, the schedule (and so the LR) unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TINY
from process_helpers import run_command, run_in_process
from run_helpers import assert_same_checkpoint, metrics

from nanoflow import io, load_config
from nanoflow.training.loop import train

# 8 steps, "sft" from step 5 with its own LR schedule (a cooldown), a checkpoint every 3 steps.
SHORT = ["tokens.train_steps=8", "data_stages.sft.start_training_step=5", "checkpoints.checkpoint_interval=3",
         'data_stages.sft.learning_rate_scheduler.lr_decay_style="1-sqrt"',
         "data_stages.sft.learning_rate_scheduler.min_decay_lr=1e-5"]


def sets(run: Path, *more: str) -> list[str]:
    return [arg for key in [*SHORT, f"checkpoints.checkpoints_path={json.dumps(str(run))}", *more]
            for arg in ("--set", key)]


@pytest.mark.slow
def test_until_step_stops_after_n_exits_0_and_trains_the_lrs_and_weights_of_the_straight_run(tmp_path, capsys):
    straight = tmp_path / "straight"
    train(load_config(TINY, [*SHORT, f"checkpoints.checkpoints_path={json.dumps(str(straight))}"]), progress=False)
    run = tmp_path / "run"

    first = run_command("train", TINY, *sets(run), "--until-step", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "stopped after step 3 of 8 as asked (until_step = 3)" in first.stdout
    assert io.latest(str(run)) == f"{run}/3" and sorted(metrics(run)) == [1, 2, 3]

    # Already past it: trains and writes nothing, a decision of the command, so taken in this process.
    again = run_in_process("train", TINY, *sets(run), "--stop-at", "2", capsys=capsys)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to do: step 3 is done, at or after until_step = 2" in again.stdout
    assert io.latest(str(run)) == f"{run}/3" and sorted(metrics(run)) == [1, 2, 3]

    second = run_command("train", TINY, *sets(run), "--stop-at", "6")   # across the stage switch at 5
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resuming from {run}/3" in second.stdout and io.latest(str(run)) == f"{run}/6"
    assert_same_checkpoint(straight / "6", run / "6")

    last = run_command("train", TINY, *sets(run))
    assert last.returncode == 0, last.stdout + last.stderr
    assert_same_checkpoint(straight / "8", run / "8")
    lrs, reference = metrics(run), metrics(straight)
    assert sorted(lrs) == list(range(1, 9))
    assert [lrs[s]["lr"] for s in lrs] == [reference[s]["lr"] for s in lrs]
    assert reference[8]["lr"] == 1e-5   # the stage's own schedule did run: its floor at its last step


def test_until_step_after_train_steps_or_below_1_is_a_clean_exit_2_before_anything_is_written(tmp_path):
    run = tmp_path / "run"
    late = run_command("train", TINY, *sets(run), "--until-step", "9")
    assert late.returncode == 2 and "Traceback" not in late.stderr
    assert "--until-step 9 is after tokens.train_steps = 8" in late.stderr
    zero = run_command("train", TINY, *sets(run), "--stop-at", "0")
    assert zero.returncode == 2 and "expected a step number" in zero.stderr
    assert not run.exists()
