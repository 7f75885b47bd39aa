"""What most test files share: the repository, its tiny schedule, a config of it that writes where the test says,
and an `out` that swallows what train() prints. Fixtures built on these live in conftest.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

from nanoflow import load_config

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "schedules" / "tiny.toml"
TRAIN_STEPS = 12   # tiny.toml's tokens.train_steps: pretrain 1–7, sft 8–12


def tiny(run: Path | str, *overrides: str, schedule: Path = TINY):
    """schedules/tiny.toml (or `schedule`) with its checkpoints in `run`, a folder or an s3:// URL."""
    return load_config(schedule, [f"checkpoints.checkpoints_path={json.dumps(str(run))}", *overrides])


def quiet() -> io.StringIO:
    """An `out` for train() and the Checkpointer whose text a test may read, or ignore."""
    return io.StringIO()
