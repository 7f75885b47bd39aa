"""Branches killed and resumed through bin/train (tests/e2e/test_branch.py: in-process)."""

from __future__ import annotations

import signal

import pytest
from helpers import REPO, quiet
from process_helpers import bin_command, run_command, sets, signal_when_ready
from run_helpers import assert_same_checkpoint, metrics
from support.branch import COOLDOWNS, branch, unchanged

from nanoflow import io, load_config
from nanoflow.training.loop import train


@pytest.mark.slow
def test_several_cooldowns_from_one_stable_run_and_one_killed_mid_step(stable, tmp_path):
    source, _ = stable
    # From step 6, straight, and again killed with SIGKILL during step 8 (after step 7 committed), then rerun.
    train(load_config(COOLDOWNS, branch(source, 6, tmp_path / "straight6")), out=quiet())
    killed = tmp_path / "killed6"
    overrides = branch(source, 6, killed, 3, "checkpoints.checkpoint_interval=1")
    command = bin_command("train", COOLDOWNS, *sets(*overrides))
    code, stdout, stderr = signal_when_ready(
        command, lambda _: (killed / "7" / "checkpoint_metadata.json").exists(), signal.SIGKILL, cwd=REPO,
        timeout=600)
    assert code == -signal.SIGKILL, stdout + stderr
    assert io.latest(str(killed)) in (f"{killed}/7", f"{killed}/8")
    resumed = train(load_config(COOLDOWNS, overrides), out=quiet())
    assert resumed.step == 9
    assert_same_checkpoint(tmp_path / "straight6" / "9", killed / "9")

    # From step 9, another cooldown: its own LR schedule (cosine, another floor) on the same stable weights.
    other = train(load_config(COOLDOWNS, branch(source, 9, tmp_path / "from9", 2,
                                                 'data_stages.cooldown.learning_rate_scheduler.lr_decay_style="cosine"',
                                                 "data_stages.cooldown.learning_rate_scheduler.min_decay_lr=0.0")),
                  out=quiet())
    assert other.step == 11 and metrics(tmp_path / "from9")[11]["lr"] == 0.0
    unchanged(stable)


@pytest.mark.slow
def test_end_to_end_a_stage_lr_until_step_and_a_branch_killed_and_resumed_equal_a_straight_run(stable, tmp_path):
    """bin/train only: a cooldown with its own LR branched from step 3, stopped with --until-step, SIGKILLed
    mid-step, stopped again with --stop-at, finished; it ends torch.equal to the same branch trained straight."""
    source, _ = stable
    train(load_config(COOLDOWNS, branch(source, 3, tmp_path / "straight", 6)), out=quiet())   # steps 4–9
    run = tmp_path / "run"
    overrides = branch(source, 3, run, 6, "checkpoints.checkpoint_interval=1")
    arguments = [COOLDOWNS, *sets(*overrides)]
    command = bin_command("train", *arguments)
    first = run_command("train", *arguments, "--until-step", "5")
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"resuming from {source}/3" in first.stdout and io.latest(str(run)) == f"{run}/5"
    code, stdout, stderr = signal_when_ready(
        command, lambda _: (run / "6" / "checkpoint_metadata.json").exists(), signal.SIGKILL, cwd=REPO, timeout=600)
    assert code == -signal.SIGKILL, stdout + stderr
    third = run_command("train", *arguments, "--stop-at", "8")
    assert third.returncode == 0, third.stdout + third.stderr
    assert "continuing them, not resume_checkpoint_path" in third.stdout and io.latest(str(run)) == f"{run}/8"
    last = run_command("train", *arguments)
    assert last.returncode == 0, last.stdout + last.stderr
    assert_same_checkpoint(tmp_path / "straight" / "9", run / "9")
    reference = metrics(tmp_path / "straight")
    assert {s: m["lr"] for s, m in metrics(run).items()} == {s: m["lr"] for s, m in reference.items()}
    assert reference[4]["lr"] == 1e-2 and reference[9]["lr"] == 1e-4
    unchanged(stable)
