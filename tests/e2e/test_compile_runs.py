"""Whole-model compile across a run: a compiled run resumed in a fresh process is bit-identical (tests/unit/test_compile.py
holds the single-forward checks)."""

import pytest
import torch
from helpers import quiet, tiny
from run_helpers import assert_same_training_state

from nanoflow.training.loop import train


@pytest.mark.slow
def test_a_compiled_run_resumed_in_a_fresh_process_is_bit_identical(tmp_path):
    """Static shapes: the graph of a stage's shape does not depend on the shapes compiled before it, so a run
    resumed after the stage switch (compiling that stage's graph first) computes what the straight run did."""
    straight = train(tiny(tmp_path / "straight", "model.compile=true"), out=quiet(), progress=False)
    train(tiny(tmp_path / "resumed", "model.compile=true", "checkpoints.checkpoint_interval=100"), until_step=10,
          out=quiet(), progress=False)
    torch._dynamo.reset()   # as a new process: nothing compiled
    resumed = train(tiny(tmp_path / "resumed", "model.compile=true"), out=quiet(), progress=False)
    assert_same_training_state(straight, resumed)
