"""The lineage of a run: where it began (resume_checkpoint_path), what load_optimizer / load_lr_scheduler did
there — once — and an LR schedule edited under a checkpoint, never silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, quiet, tiny
from run_helpers import assert_same_training_state, metrics

from nanoflow import io, load_config
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.errors import NanoflowError
from nanoflow.lr import scheduled_lr
from nanoflow.schedule import Schedule
from nanoflow.training.loop import train

COOLDOWNS = REPO / "schedules" / "cooldowns.toml"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny run stopped after step 4: the branch point."""
    run = tmp_path_factory.mktemp("source")
    train(tiny(run), until_step=4, out=quiet())
    return run


def branch_config(source: Path, run: Path, flag: str, async_save: bool):
    return tiny(run, f"checkpoints.resume_checkpoint_path={json.dumps(str(source / '4'))}", f"checkpoints.{flag}=false",
                f"checkpoints.async_save={str(async_save).lower()}", "checkpoints.checkpoint_interval=2")


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("flag", ["load_optimizer", "load_lr_scheduler"])
def test_the_load_flags_act_once_at_the_branch_point_not_at_each_resume_of_the_branch(source, tmp_path, flag,
                                                                                       async_save):
    straight = train(branch_config(source, tmp_path / "straight", flag, async_save), out=quiet())
    config = branch_config(source, tmp_path / "run", flag, async_save)
    first = quiet()
    train(config, until_step=6, out=first)                     # branch point 4 → 6
    assert f"resuming from {source}/4" in first.getvalue()
    second = quiet()
    train(config, until_step=9, out=second)                    # its own 6 → 9, across the sft boundary at 8
    assert f"resuming from {tmp_path / 'run'}/6" in second.getvalue()
    resumed = train(config, out=quiet())                       # its own 9 (or 8 under async) → 12
    assert_same_training_state(straight, resumed)              # weights, moments, AdamW step counts, LR origin
    assert resumed.lr_origin == (4 if flag == "load_lr_scheduler" else 0)
    want = {s: m["lr"] for s, m in metrics(tmp_path / "straight").items()}
    assert {s: m["lr"] for s, m in metrics(tmp_path / "run").items()} == want
    lineage = io.read_metadata(str(tmp_path / "run"))["lineage"]
    history = lineage.pop("history")
    assert lineage == {"optimizer_origin": 4 if flag == "load_optimizer" else 0,
                       "began_from": f"{source}/4", "began_at": 4}
    # One history, drawn at the branch point and kept by each resume: every checkpoint of the run records it.
    steps = [p for p in (tmp_path / "run").iterdir() if p.name.isdigit()]
    assert len(steps) > 1 and {io.read_metadata(str(p))["lineage"]["history"] for p in steps} == {history}


def test_without_a_resume_path_the_flags_do_not_reset_a_runs_own_resume_and_say_so(tmp_path):
    straight = train(tiny(tmp_path / "straight"), out=quiet())
    train(tiny(tmp_path / "run"), until_step=5, out=quiet())
    out = quiet()
    resumed = train(tiny(tmp_path / "run", "checkpoints.load_optimizer=false", "checkpoints.load_lr_scheduler=false"),
                    out=out)
    assert_same_training_state(straight, resumed)
    assert "load_optimizer = false and load_lr_scheduler = false act only when a run starts from " \
           "resume_checkpoint_path" in out.getvalue()


@pytest.mark.parametrize("layout", ["step folder", "run folder"])   # the second: nanotron's resume example
def test_a_resume_path_inside_the_runs_own_folder_is_started_from_once_then_its_newest_own_is_continued(
        tmp_path, layout):
    reference = train(tiny(tmp_path / "reference"), out=quiet())
    run = tmp_path / "run"
    if layout == "step folder":
        train(tiny(run), out=quiet())                          # 4, 8, 12: the history the branch rewinds
        start = run / "4"
    else:
        start = run / "base"
        train(tiny(start), until_step=4, out=quiet())
    config = tiny(run, f"checkpoints.resume_checkpoint_path={json.dumps(str(start))}",
                  "checkpoints.checkpoint_interval=2")
    first = quiet()
    train(config, until_step=6, out=first)
    assert f"resuming from {run}/4: step 4 done" in first.getvalue() or \
        f"resuming from {start}/4: step 4 done" in first.getvalue()
    if layout == "step folder":                                # the history it rewinds is named, and kept for now
        assert f"holds checkpoints that did not begin from resume_checkpoint_path = {start} (the newest, {run}/12, " \
               "started afresh)" in first.getvalue(), first.getvalue()
    again = quiet()
    resumed = train(config, out=again)                         # the same command: its own 6, not 4 again
    assert f"resuming from {run}/6: step 6 done" in again.getvalue(), again.getvalue()
    assert f"not resume_checkpoint_path = {start}" in again.getvalue()
    assert_same_training_state(reference, resumed)
    done = quiet()
    train(config, out=done)
    assert f"nothing to do: {run}/12 has all 12 steps done" in done.getvalue(), done.getvalue()


# ---------------------------------------------------------------------------------------------
# An LR schedule edited under a checkpoint (cooldowns.toml: "stable" at a constant LR, "cooldown" decays)

TAIL_STAGE = """
[[data_stages]]
name = "tail"
start_training_step = {start}
[data_stages.data.dataset]
hf_dataset_or_datasets = "text"
hf_data_files = "{words}/pretrain.txt"
"""

def cooldowns(tmp_path: Path, run: Path, *more: str, tail: int | None = None):
    """cooldowns.toml with "cooldown" from step 7 to 12 (its own decay to its last step), optionally a stage "tail"
    inserted at step `tail`, which ends the cooldown earlier."""
    text = COOLDOWNS.read_text().replace('"data/words/', f'"{REPO}/schedules/data/words/')
    if tail is not None:
        text += TAIL_STAGE.format(start=tail, words=f"{REPO}/schedules/data/words")
    path = tmp_path / f"cooldowns-{tail}.toml"
    path.write_text(text)
    return load_config(path, [f"checkpoints.checkpoints_path={json.dumps(str(run))}",
                              "data_stages.cooldown.start_training_step=7", *more])


@pytest.mark.parametrize("edit", ["stage inserted", "last stage longer"])
def test_a_begun_stages_length_edited_under_a_checkpoint_is_refused_naming_the_stage_and_the_lr_jump(tmp_path, edit):
    run = tmp_path / "run"
    train(cooldowns(tmp_path, run), until_step=9, out=quiet())
    if edit == "stage inserted":
        config, change = cooldowns(tmp_path, run, tail=11), '+ stage "tail" starts at step 11'
    else:
        config, change = cooldowns(tmp_path, run, "tokens.train_steps=14"), "tokens.train_steps was 12, the config now says 14"
    before = scheduled_lr(10, cooldowns(tmp_path, run), Schedule.from_config(cooldowns(tmp_path, run)))
    after = scheduled_lr(10, config, Schedule.from_config(config))
    assert before != after
    with pytest.raises(NanoflowError) as refused:
        Checkpointer(config, out=quiet()).restore()
    message = str(refused.value)
    assert 'stage "cooldown"' in message and change in message, message
    assert f"step 10 trains at {after:.4g}, not the {before:.4g} this checkpoint's config gives it" in message, message
    assert "ignore_lr_schedule_change = true" in message
    assert io.latest(str(run)) == f"{run}/9"


def test_an_lr_schedule_edit_allowed_by_the_opt_in_is_said_once_and_trains_the_new_lrs(tmp_path):
    run = tmp_path / "run"
    train(cooldowns(tmp_path, run), until_step=9, out=quiet())
    config = cooldowns(tmp_path, run, "checkpoints.ignore_lr_schedule_change=true", "checkpoints.checkpoint_interval=1",
                       tail=11)
    out = quiet()
    train(config, until_step=10, out=out)
    before = scheduled_lr(10, cooldowns(tmp_path, run), Schedule.from_config(cooldowns(tmp_path, run)))
    after = scheduled_lr(10, config, Schedule.from_config(config))
    assert f"step 10 trains at {after:.4g}, not the {before:.4g}" in out.getvalue(), out.getvalue()
    assert "resuming anyway, as checkpoints.ignore_lr_schedule_change = true says" in out.getvalue()
    assert metrics(run)[10]["lr"] == after
    again = quiet()
    train(config, out=again)                                  # its own checkpoint of step 10 has the new schedule
    assert "trains at" not in again.getvalue(), again.getvalue()
    assert metrics(run)[12]["stage"] == "tail"


def test_editing_a_stage_not_begun_that_leaves_the_begun_stages_lr_alone_is_not_flagged(tmp_path):
    run = tmp_path / "run"
    train(cooldowns(tmp_path, run, "data_stages.cooldown.start_training_step=13"), until_step=4, out=quiet())
    out = quiet()
    state = train(cooldowns(tmp_path, run), until_step=5, out=out)   # the stable LR is constant: cooldown may move
    assert state.step == 5 and "trains at" not in out.getvalue()
