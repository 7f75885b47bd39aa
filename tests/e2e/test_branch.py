"""Cooldowns branched from any checkpoint of a stable run: each is a new run whose resume_checkpoint_path names
a step folder of the stable run. A branch resumes exactly, and the stable run's folder is never written to."""

from __future__ import annotations

import os

import pytest
from helpers import quiet
from run_helpers import assert_same_checkpoint, metrics
from support.branch import COOLDOWNS, branch, unchanged

from nanoflow import io, load_config
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.schedule import ScheduleDriftError
from nanoflow.training.loop import train


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


