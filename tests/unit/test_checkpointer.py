"""The Checkpointer's own API (restore, should_save, save, locked), the public API a notebook uses, and io's layering."""

import io as text_io
import json
from pathlib import Path

import attrs
import helpers
import pytest
import torch
from helpers import tiny
from run_helpers import assert_same_training_state

import nanoflow
from nanoflow import Checkpointer, init_state, io, stage_data, train_step
from nanoflow.errors import ScheduleDriftError
from nanoflow.io.checkpoint import save_checkpoint
from nanoflow.parallel.shards import state_blocks


def trained(config, steps: int):
    """A fresh state of `config` after `steps` steps, each batch from the stage the state is at."""
    state = init_state(config)
    for _ in range(steps):
        with stage_data(state) as loader:
            state, _ = train_step(state, loader.batch_at(state.step + 1))
    return state


def test_should_save_at_the_interval_the_end_and_a_stop(tmp_path):
    checkpointer = Checkpointer(tiny(tmp_path, "tokens.train_steps=12", "checkpoints.checkpoint_interval=5"))
    assert [s for s in range(1, 13) if checkpointer.should_save(s, None)] == [5, 10, 12]
    assert checkpointer.should_save(3, "SIGTERM") and not checkpointer.should_save(3, None)


def test_restore_save_restore_round_trip_is_bit_identical(tmp_path):
    config = tiny(tmp_path)
    state = trained(config, 3)
    out = text_io.StringIO()
    checkpointer = Checkpointer(config, out=out)
    with checkpointer.locked():
        assert checkpointer.save(state) == f"{tmp_path}/3"
    restored = Checkpointer(config, out=out).restore()
    assert "resuming from" in out.getvalue() and f"{tmp_path}/3: step 3 done, next step 4" in out.getvalue()
    assert_same_training_state(state, restored)
    assert restored.run is not state.run and restored.schedule == state.schedule
    # and on from both, the same next step
    with stage_data(state) as loader:
        batch = loader.batch_at(4)
    (a, _), (b, _) = train_step(state, batch), train_step(restored, batch)
    assert_same_training_state(a, b)
    assert Checkpointer(config, out=out).restore(fresh=True).step == 0   # fresh ignores it, and says so
    assert "--fresh: starting from step 1, ignoring the committed checkpoints" in out.getvalue()


def test_checkpoints_no_longer_hold_an_rng_group_but_old_ones_still_restore(tmp_path):
    config = tiny(tmp_path / "new")
    state = trained(config, 2)
    folder = Checkpointer(config, out=text_io.StringIO()).save(state)
    assert sorted(p.name for p in Path(folder).iterdir() if p.is_dir()) == ["model", "optimizer"]
    metadata = io.read_metadata(folder)
    assert set(metadata["tensors"]) == {"model", "optimizer"}
    # A checkpoint as nanoflow wrote it before: the same tensors plus rank 0's generator state in "rng".
    old = str(tmp_path / "old")
    groups = {**state_blocks(state.model, state.optimizer, state.topology),
              "rng": {"cpu": torch.Generator().manual_seed(1).get_state()}}
    info = {k: v for k, v in metadata.items() if k in ("training", "lr_origin", "topology", "config",
                                                       "data_fingerprint")}
    save_checkpoint(old, 2, groups, info)
    assert "rng" in io.read_metadata(old)["tensors"]
    restored = Checkpointer(tiny(tmp_path / "other", f'checkpoints.resume_checkpoint_path="{old}"'),
                            out=text_io.StringIO()).restore()
    assert_same_training_state(state, restored)


def test_a_consumed_state_is_not_saved(tmp_path):
    config = tiny(tmp_path)
    state = init_state(config)
    with stage_data(state) as loader:
        train_step(state, loader.batch_at(1))
    with pytest.raises(nanoflow.StaleStateError):
        Checkpointer(config).save(state)
    assert not list(tmp_path.iterdir())


def test_state_holds_only_what_changes(tmp_path):
    state = init_state(tiny(tmp_path))
    assert not hasattr(state, "rng_state")
    with pytest.raises(AttributeError):
        state.config = None   # derived from the run, never set on a state
    assert state.config is state.run.config and state.topology is state.run.topology
    assert state.consumed_samples == (0, 0)


def test_public_api():
    assert {"load_config", "init_state", "train_step", "TrainState", "Checkpointer", "stage_data"} <= set(
        nanoflow.__all__)


# ---------------------------------------------------------------------------------------------
# [model] keys under a checkpoint (nanoflow.config.MODEL_KEYS): refused by name, or said

@pytest.fixture(scope="module")
def saved_at_step_2(tmp_path_factory):
    """A run folder of the tiny schedule with a committed checkpoint of step 2."""
    run = tmp_path_factory.mktemp("model_keys") / "run"
    config = tiny(run)
    Checkpointer(config, out=text_io.StringIO()).save(trained(config, 2))
    return run


def test_a_model_setting_the_weights_were_trained_under_is_refused_by_name(saved_at_step_2):
    with pytest.raises(io.CheckpointError) as error:
        Checkpointer(tiny(saved_at_step_2, "model.rms_norm_eps=0.1"), out=text_io.StringIO()).restore()
    message = str(error.value)
    assert (f"{saved_at_step_2}/2 holds a different model:\n  model.rms_norm_eps was 1e-05, the config now says 0.1 "
            "(the weights were trained under it)") in message
    assert f"init_from = {saved_at_step_2}/2" in message   # what to do for a deliberate change


def test_a_deliberate_change_of_the_numbers_resumes_with_a_warning(saved_at_step_2):
    out = text_io.StringIO()
    assert Checkpointer(tiny(saved_at_step_2, 'model.dtype="bfloat16"'), out=out).restore().step == 2
    assert "warning: resuming with model.dtype = 'bfloat16' (was 'float32'): the steps from here compute in it" \
        in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("overrides, lines", [
    (["model.rope_theta=500000.0"], ['stage "pretrain": rope_theta was 10000.0, the config now says 500000.0']),
    (['data_stages.pretrain.rope_scaling={rope_type = "linear", factor = 2.0}'],
     ["stage \"pretrain\": rope_scaling was None, the config now says {'rope_type': 'linear', 'factor': 2.0}"]),
    (["data_stages.pretrain.rope_theta=10000.0"], []),   # the same RoPE, now stated by the stage
    (["data_stages.sft.rope_theta=500000.0", 'data_stages.sft.rope_scaling={rope_type = "linear", factor = 2.0}'],
     []),                                              # a stage not begun: the future
    (["model.rope_theta=500000.0", "data_stages.pretrain.rope_theta=10000.0"], []),   # only the future inherits it
])
def test_a_begun_stages_rope_is_history(saved_at_step_2, overrides, lines):
    """A stage's RoPE is part of the stage: the checkpoint's begun stage "pretrain" keeps its own, whether [model]
    or the stage set it; "sft" has not begun and may be anything."""
    config = tiny(saved_at_step_2, *overrides)
    if not lines:
        out = text_io.StringIO()
        assert Checkpointer(config, out=out).restore().step == 2
        if "model.rope_theta=500000.0" in overrides:   # said, as what the stages after inherit
            assert "resuming with model.rope_theta = 500000.0 (was 10000.0): the RoPE of the stages" in out.getvalue()
        return
    with pytest.raises(ScheduleDriftError) as error:
        Checkpointer(config, out=text_io.StringIO()).restore()
    message = str(error.value)
    assert f"{saved_at_step_2}/2: the RoPE of stages this checkpoint has trained differs" in message
    assert all(line in message for line in lines), message
    assert "start a new stage there with its own rope_theta" in message and "from step 3" in message


def test_a_shape_change_is_refused_without_the_init_from_advice(saved_at_step_2):
    with pytest.raises(io.CheckpointError) as error:
        Checkpointer(tiny(saved_at_step_2, "model.num_hidden_layers=3", "model.rms_norm_eps=0.1"),
                     out=text_io.StringIO()).restore()
    message = str(error.value)
    assert "model.num_hidden_layers was 2, the config now says 3\n  model.rms_norm_eps was 1e-05" in message
    assert "init_from" not in message


def test_bin_train_refuses_a_changed_model_setting_with_exit_2(saved_at_step_2, capsys):
    from nanoflow.commands.cli import train_main

    status = train_main([str(helpers.TINY), "--set", f'checkpoints.checkpoints_path="{saved_at_step_2}"',
                         "--set", "model.rms_norm_eps=0.1"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "model.rms_norm_eps was 1e-05, the config now says 0.1" in err and "Traceback" not in err
    assert io.read_metadata(str(saved_at_step_2))["step"] == 2   # nothing trained, nothing saved


def test_a_harmless_model_change_resumes_and_is_said(saved_at_step_2):
    out = text_io.StringIO()
    state = Checkpointer(tiny(saved_at_step_2, "model.initializer_range=0.5", "model.max_position_embeddings=128"),
                         out=out).restore()
    assert state.step == 2
    assert "resuming with model.initializer_range = 0.5 (was 0.02): it draws the weights of a fresh start only" \
        in out.getvalue()
    assert "model.max_position_embeddings = 128 (was 64)" in out.getvalue()


def test_every_model_key_is_classified_once_and_old_records_read_as_their_defaults():
    from nanoflow.config import MODEL_KEYS, ModelArgs, model_changes

    assert set(MODEL_KEYS) == set(attrs.fields_dict(ModelArgs))   # a new [model] key must say what it is to weights
    assert {role for role, _, _ in MODEL_KEYS.values()} == {"shape", "numbers", "changes", "free"}
    from nanoflow.parallel.runtime import resolved

    config = tiny("unused")
    assert config.model.dtype == "auto"
    current = resolved(config, torch.device("cpu")).to_dict()["model"]   # what a run on a CPU records
    assert current["dtype"] == "float32"
    # A checkpoint written before nanoflow had dtype, rope_scaling or compile: trained with their defaults then
    # (dtype's was float32, before "auto").
    older = {k: v for k, v in current.items() if k not in ("dtype", "compile", "rope_scaling")}
    assert model_changes(older, current) == {"shape": [], "numbers": [], "changes": [], "free": []}
    on_a_gpu = resolved(config, torch.device("cuda")).to_dict()["model"]   # resolving reads only the device's kind
    assert model_changes(older, on_a_gpu)["changes"] == model_changes(current, on_a_gpu)["changes"] == [
        "model.dtype = 'bfloat16' (was 'float32'): the steps from here compute in it; the weights and moments stay "
        "float32"]


def test_fresh_says_it_does_not_use_a_resume_checkpoint_path_that_holds_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    config = tiny(tmp_path / "run", f"checkpoints.resume_checkpoint_path={json.dumps(str(tmp_path / 'empty'))}")
    out = text_io.StringIO()
    assert Checkpointer(config, out=out).restore(fresh=True).step == 0
    assert f"checkpoints.resume_checkpoint_path = {tmp_path / 'empty'} is not used" in out.getvalue(), out.getvalue()
