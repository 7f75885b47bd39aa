"""Cooldowns branched from any checkpoint of a stable run: each is a new run whose resume_checkpoint_path names
a step folder of the stable run. A branch resumes exactly, and the stable run's folder is never written to."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest
from helpers import REPO, quiet
from process_helpers import bin_command, run_command, sets, signal_when_ready
from run_helpers import assert_same_checkpoint, folder_digest, metrics

from nanoflow import io, load_config
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.training.loop import train
from nanoflow.schedule import ScheduleDriftError

COOLDOWNS = REPO / "schedules" / "cooldowns.toml"   # "stable" at a constant LR, then a "cooldown" stage
STABLE = ["tokens.train_steps=9", "data_stages.cooldown.start_training_step=10"]   # checkpoints 3, 6, 9


def branch(source: Path, step: int, run: Path, length: int = 3, *more: str) -> list[str]:
    """The overrides of a cooldown of `length` steps branched from `source`/`step` into `run`."""
    return [f"general.run=cooldown-{step}", f"checkpoints.checkpoints_path={json.dumps(str(run))}",
            f"checkpoints.resume_checkpoint_path={json.dumps(str(source / str(step)))}",
            f"data_stages.cooldown.start_training_step={step + 1}", f"tokens.train_steps={step + length}", *more]


@pytest.fixture(scope="module")
def stable(tmp_path_factory):
    """The stable run, finished, and its folder made read-only: any write into it fails loudly."""
    source = tmp_path_factory.mktemp("stable") / "run"
    train(load_config(COOLDOWNS, [*STABLE, f"checkpoints.checkpoints_path={json.dumps(str(source))}"]), out=quiet())
    digest = folder_digest(source)
    writable = {}
    for path in [source, *source.rglob("*")]:
        writable[path] = path.stat().st_mode
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    yield source, digest
    for path, mode in writable.items():
        path.chmod(mode)


def unchanged(stable) -> None:
    source, digest = stable
    assert folder_digest(source) == digest


@pytest.mark.slow
def test_a_branch_stopped_and_resumed_ends_equal_to_a_straight_branch_and_the_source_is_unchanged(stable, tmp_path):
    source, _ = stable
    straight = train(load_config(COOLDOWNS, branch(source, 3, tmp_path / "straight", 4)), out=quiet())
    assert straight.step == 7
    lrs = metrics(tmp_path / "straight")
    assert sorted(lrs) == [4, 5, 6, 7]                          # the branch trains only its own steps
    assert lrs[4]["stage"] == "cooldown" and lrs[4]["lr"] == 1e-2   # the stable LR at the join: decay from here
    assert lrs[7]["lr"] == 1e-4                                 # min_decay_lr at the cooldown's last step

    config = load_config(COOLDOWNS, branch(source, 3, tmp_path / "stopped", 4))
    train(config, until_step=5, out=quiet())
    out = quiet()
    train(config, out=out)                                       # the same command again: its own checkpoint
    assert f"holds this run's own checkpoints: continuing them, not resume_checkpoint_path = {source}/3" in \
        out.getvalue()
    assert f"resuming from {tmp_path / 'stopped'}/5" in out.getvalue()
    assert_same_checkpoint(tmp_path / "straight" / "7", tmp_path / "stopped" / "7")
    assert [m["lr"] for m in metrics(tmp_path / "stopped").values()] == [m["lr"] for m in lrs.values()]
    unchanged(stable)


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
        timeout=300)
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


def test_a_branch_whose_begun_stages_differ_from_the_source_is_refused_and_writes_nothing(stable, tmp_path):
    source, _ = stable
    config = load_config(COOLDOWNS, branch(source, 6, tmp_path / "bad", 3, "data_stages.stable.sequence_length=16"))
    with pytest.raises(ScheduleDriftError, match="stable"):
        Checkpointer(config, out=quiet()).restore()
    unchanged(stable)
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


def test_the_source_folder_is_only_read_the_lock_is_the_branchs(stable, tmp_path):
    """The lock is taken on the branch's own checkpoints_path; nothing (lock, latest.txt, clean-up) touches the
    source, which here cannot even be written to."""
    source, _ = stable
    assert not os.access(source, os.W_OK) or os.geteuid() == 0
    state = train(load_config(COOLDOWNS, branch(source, 6, tmp_path / "b")), until_step=7, out=quiet())
    assert state.step == 7 and io.latest(str(tmp_path / "b")) == f"{tmp_path / 'b'}/7"
    assert (tmp_path / "b" / "nanoflow.lock").exists()
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
        command, lambda _: (run / "6" / "checkpoint_metadata.json").exists(), signal.SIGKILL, cwd=REPO, timeout=300)
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
