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


def assert_same_steps(results) -> None:
    """Each (loss, grad_norm, named parameters) step result equals the first one's in loss, gradient norm and
    every gradient, to float32 rounding: the same step taken another way (micro-batches, loss path)."""
    import pytest
    import torch

    loss, grad_norm, params = results[0]
    for other_loss, other_norm, other_params in results[1:]:
        assert other_loss == pytest.approx(loss, abs=1e-6)
        assert other_norm == pytest.approx(grad_norm, abs=1e-6)
        for name, p in params.items():
            torch.testing.assert_close(other_params[name].grad, p.grad, rtol=0, atol=1e-6, msg=name)

