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

# The [model] table of the configs tests write out themselves: tiny.toml's widths and vocabulary, one layer.
SMALL_MODEL_TOML = """\
[model]
vocab_size = 288
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 1
num_attention_heads = 4
max_position_embeddings = 64
"""


def tiny(run: Path | str, *overrides: str, schedule: Path = TINY):
    """schedules/tiny.toml (or `schedule`) with its checkpoints in `run`, a folder or an s3:// URL."""
    return load_config(schedule, [f"checkpoints.checkpoints_path={json.dumps(str(run))}", *overrides])


def quiet() -> io.StringIO:
    """An `out` for train() and the Checkpointer whose text a test may read, or ignore."""
    return io.StringIO()
