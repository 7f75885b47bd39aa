"""What test_branch.py and its process-level tests share."""

from __future__ import annotations

import contextlib
import json
import stat
from pathlib import Path

from helpers import REPO, quiet
from run_helpers import folder_digest

from nanoflow import load_config
from nanoflow.training.loop import train

COOLDOWNS = REPO / "schedules" / "cooldowns.toml"   # "stable" at a constant LR, then a "cooldown" stage
STABLE = ["tokens.train_steps=9", "data_stages.cooldown.start_training_step=10"]   # checkpoints 3, 6, 9


def branch(source: Path, step: int, run: Path, length: int = 3, *more: str) -> list[str]:
    """The overrides of a cooldown of `length` steps branched from `source`/`step` into `run`."""
    return [f"general.run=cooldown-{step}", f"checkpoints.checkpoints_path={json.dumps(str(run))}",
            f"checkpoints.resume_checkpoint_path={json.dumps(str(source / str(step)))}",
            f"data_stages.cooldown.start_training_step={step + 1}", f"tokens.train_steps={step + length}", *more]


@contextlib.contextmanager
def stable_run(source: Path):
    """The stable run trained into `source`, its folder read-only while the block runs: any write into it fails
    loudly."""
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
