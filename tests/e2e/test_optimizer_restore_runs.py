"""Whole runs resume with the AdamW implementation they trained with: fused, or unfused when the config leaves it
unset (tests/unit/test_optimizer_restore.py: the state restored against torch's load_state_dict)."""

from __future__ import annotations

from helpers import quiet, tiny
from run_helpers import assert_same_training_state

from nanoflow.build import is_fused
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.io import read_metadata
from nanoflow.training.loop import train


def test_a_run_trained_unfused_resumes_unfused_when_the_config_leaves_it_unset(tmp_path):
    # Checkpoints written before fused became the default record torch_adam_is_fused = false: their runs go on as
    # they trained, bit for bit, with the key unset; a config that names the other implementation is warned of.
    off = "optimizer.optimizer_factory.torch_adam_is_fused=false"
    straight = train(tiny(tmp_path / "straight", off), out=quiet())
    train(tiny(tmp_path / "run", off, "checkpoints.checkpoint_interval=100"), until_step=6, out=quiet())
    out = quiet()
    resumed = train(tiny(tmp_path / "run"), out=out)   # the key unset now
    assert not is_fused(resumed.optimizer) and "torch_adam_is_fused" not in out.getvalue()
    assert_same_training_state(straight, resumed)

    train(tiny(tmp_path / "switched", off, "checkpoints.checkpoint_interval=100"), until_step=6, out=quiet())
    out = quiet()
    switched = train(tiny(tmp_path / "switched", "optimizer.optimizer_factory.torch_adam_is_fused=true"), out=out)
    assert is_fused(switched.optimizer)
    assert ("resuming with optimizer.optimizer_factory.torch_adam_is_fused = true (was false): AdamW's updates round "
            "otherwise from here") in out.getvalue()


def test_a_fused_run_records_fused_and_resumes_fused(tmp_path):
    train(tiny(tmp_path, "checkpoints.checkpoint_interval=100"), until_step=5, out=quiet())
    assert read_metadata(str(tmp_path / "5"))["config"]["optimizer"]["optimizer_factory"]["torch_adam_is_fused"] is True
    restored = Checkpointer(tiny(tmp_path), out=quiet()).restore()
    assert is_fused(restored.optimizer)

