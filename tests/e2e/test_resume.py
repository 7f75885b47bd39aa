"""Resume: a run that stops and resumes ends exactly where an uninterrupted run ends."""

import json
import os
import re

import pytest
import torch
from helpers import quiet, tiny
from log_helpers import logged
from process_helpers import run_in_process, train_args
from run_helpers import assert_same_training_state

from nanoflow import io
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.io.marker import FORMAT, sealed
from nanoflow.io.store import StoreError
from nanoflow.lr import lr_at
from nanoflow.observe.metrics import MetricsLog
from nanoflow.schedule import ScheduleDriftError
from nanoflow.training.loop import train


def restore(config, *, fresh: bool = False, out):
    return Checkpointer(config, out=out).restore(fresh=fresh)


# Stage "sft" starts at step 8 with its own sequence length and batch: stop before, at and after it.
@pytest.mark.parametrize("k", [3, 7, 8, 10])
def test_stop_and_resume_is_bit_identical(straight, tmp_path, k):
    reference, _ = straight
    train(tiny(tmp_path, "checkpoints.checkpoint_interval=100"), until_step=k, out=quiet())
    assert io.latest(str(tmp_path)) == f"{tmp_path}/{k}"
    out = quiet()
    resumed = train(tiny(tmp_path), out=out)
    assert f"resuming from {tmp_path}/{k}: step {k} done" in out.getvalue()
    assert_same_training_state(reference, resumed)


def test_metrics_log_continues_without_duplicates(tmp_path):
    train(tiny(tmp_path), until_step=5, out=quiet())
    train(tiny(tmp_path), out=quiet())
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))


def test_metrics_log_drops_only_the_lines_after_the_resume_step_reading_from_the_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    history = "not json: the history before the resume step is never read\n"
    lines = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)]
    path.write_text(history + "".join(lines) + '{"step": 9, "lo')  # step 9's line cut by a kill
    MetricsLog(path, 5)
    assert path.read_text() == history + "".join(lines[:5])
    MetricsLog(path, 5)
    assert path.read_text() == history + "".join(lines[:5])
    MetricsLog(path, 0)  # a fresh start keeps nothing
    assert path.read_text() == ""
    MetricsLog(tmp_path / "new.jsonl", 3)
    assert (tmp_path / "new.jsonl").read_text() == ""


def test_checkpoint_contents_and_layout(straight):
    reference, run = straight
    assert (run / "latest.txt").read_text().strip() == "12"
    meta = io.read_metadata(str(run))
    assert meta["step"] == 12 and meta["training"]["completed"] == 12
    assert [s["name"] for s in meta["training"]["stages"]] == ["pretrain", "sft"]
    assert meta["training"]["consumed_samples"] == list(reference.consumed_samples)
    assert meta["config"]["tokens"]["train_steps"] == 12
    assert set(meta["versions"]) >= {"nanoflow", "torch"}
    for name, entry in meta["files"].items():
        assert (run / "12" / name).stat().st_size == entry["bytes"]
    weights = io.read_model(str(run))
    for name, p in reference.model.named_parameters():
        assert torch.equal(weights[name], p), name
    assert not list(run.rglob("*.pkl")) and not list(run.rglob("*.pt"))


# The flags act where a run starts from resume_checkpoint_path (here an older step of its own folder), once:
# tests/e2e/test_lineage.py holds the resumes after it.
def test_load_optimizer_false_starts_fresh_moments_and_keeps_position(tmp_path):
    train(tiny(tmp_path), until_step=5, out=quiet())
    state = restore(tiny(tmp_path, "checkpoints.load_optimizer=false",
                         f'checkpoints.resume_checkpoint_path="{tmp_path}/5"'), out=quiet())
    assert state.step == 5 and state.consumed_samples == (20, 0)
    assert len(state.optimizer.state) == 0
    assert state.lr_origin == 0
    assert torch.equal(io.read_model(str(tmp_path))["model.norm.weight"], state.model.model.norm.weight)


def test_load_lr_scheduler_false_restarts_warmup_at_the_resume_step(tmp_path):
    train(tiny(tmp_path), until_step=5, out=quiet())
    config = tiny(tmp_path, "checkpoints.load_lr_scheduler=false", f'checkpoints.resume_checkpoint_path="{tmp_path}/5"')
    state = restore(config, out=quiet())
    assert state.lr_origin == 5 and len(state.optimizer.state) > 0
    train(config, out=quiet())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    args = config.optimizer.learning_rate_scheduler
    assert lines[5]["step"] == 6
    assert lines[5]["lr"] == pytest.approx(args.learning_rate / args.lr_warmup_steps)  # warmup step 1 again
    assert lines[5]["lr"] == pytest.approx(lr_at(6, args, 12, origin=5))


def test_init_from_starts_a_new_run_from_existing_weights(straight, tmp_path):
    _, run = straight
    state = restore(tiny(tmp_path / "new", f'model.init_from="{run}"'), out=quiet())
    assert state.step == 0 and len(state.optimizer.state) == 0
    for name, tensor in io.read_model(str(run)).items():
        assert torch.equal(dict(state.model.named_parameters())[name], tensor), name


def test_rewriting_a_begun_stage_is_refused_with_the_difference(tmp_path):
    train(tiny(tmp_path), until_step=9, out=quiet())
    with pytest.raises(ScheduleDriftError, match='stage "sft": sequence_length was 24, the config now says 16'):
        restore(tiny(tmp_path, "data_stages.sft.sequence_length=16"), out=quiet())


def test_editing_a_stage_not_yet_begun_is_allowed_and_takes_effect(tmp_path):
    train(tiny(tmp_path), until_step=5, out=quiet())
    state = train(tiny(tmp_path, "data_stages.sft.sequence_length=20"), out=quiet())
    assert state.step == 12
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["stage"] == "sft" and last["tokens"] == 8 * 20


def test_resume_from_a_named_step_folder_of_another_run(straight, tmp_path):
    _, run = straight
    state = restore(tiny(tmp_path, f'checkpoints.resume_checkpoint_path="{run}/8"'), out=quiet())
    assert state.step == 8


def test_fresh_ignores_existing_checkpoints(straight, tmp_path):
    train(tiny(tmp_path), until_step=4, out=quiet())
    assert restore(tiny(tmp_path), fresh=True, out=quiet()).step == 0


def test_branching_from_an_older_step_replaces_later_steps_only_once_committed(tmp_path, straight):
    reference, _ = straight
    train(tiny(tmp_path), out=quiet())                              # commits 4, 8, 12
    old_files = set((tmp_path / "8").rglob("*.safetensors"))
    config = tiny(tmp_path, f'checkpoints.resume_checkpoint_path="{tmp_path}/4"')
    state = train(config, out=quiet())                              # saves 8 and 12 again
    assert_same_training_state(reference, state)
    new_files = set((tmp_path / "8").rglob("*.safetensors"))
    assert new_files and not (new_files & old_files)                # new names; the old ones are gone
    assert io.latest(str(tmp_path)) == f"{tmp_path}/12"


def test_retention_keeps_the_newest_and_removes_incomplete_steps(tmp_path):
    (tmp_path / "3" / "model").mkdir(parents=True)                  # a save that never committed
    (tmp_path / "3" / ".nanoflow-save").write_text("a save of step 3 by nanoflow\n")
    (tmp_path / "3" / "model" / "rank00000.safetensors.tmp-4242").write_bytes(b"partial")
    train(tiny(tmp_path, "checkpoints.keep=2", "checkpoints.checkpoint_interval=2"), out=quiet())
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["10", "12"]


def test_nanoflow_deletes_only_what_it_wrote(tmp_path):
    thesis = tmp_path / "2024" / "thesis.tex"                       # the user's, with a step-like name
    thesis.parent.mkdir()
    thesis.write_text("\\documentclass{article}")
    notes = tmp_path / "4" / "notes.txt"                            # the user's, inside a step folder to come
    notes.parent.mkdir()
    notes.write_text("step 4 looked good")
    stray = tmp_path / "7" / "model" / "rank00000.safetensors"      # nanoflow's name, but no save marker: not ours
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"who knows")
    out = quiet()
    train(tiny(tmp_path, "checkpoints.keep=2", "checkpoints.checkpoint_interval=2"), out=out)
    assert thesis.read_text() == "\\documentclass{article}" and notes.read_text() == "step 4 looked good"
    assert stray.read_bytes() == b"who knows"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "4").rglob("*")) == ["4/notes.txt"]
    assert io.checkpoints_to_try(str(tmp_path)) == [f"{tmp_path}/12", f"{tmp_path}/10"]
    assert "warning" not in out.getvalue()                          # folders not nanoflow's are none of its business


def test_temporaries_of_killed_or_failed_writes_are_cleaned_by_the_next_save(tmp_path, monkeypatch):
    tensors = {"model": {"w": torch.ones(8)}}
    io.save_checkpoint(str(tmp_path), 1, tensors, {"training": {"completed": 1}})
    orphans = [tmp_path / "1" / "model" / "rank00000.safetensors.tmp-4242", tmp_path / "latest.txt.tmp-4242",
               tmp_path / "1" / "checkpoint_metadata.json.tmp-77"]
    mine = [tmp_path / "1" / "model" / "mine.tmp-1", tmp_path / "scratch.tmp-1"]   # not names nanoflow writes
    for path in orphans + mine:
        path.write_bytes(b"left by a kill")
    io.save_checkpoint(str(tmp_path), 2, tensors, {"training": {"completed": 2}})
    assert not [p for p in orphans if p.exists()] and all(p.exists() for p in mine)
    # A write that fails (here: the disk is full as it syncs) removes its temporary file and names the path.
    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StoreError, match=rf"cannot write {tmp_path}/3/.nanoflow-save: \[Errno 28\] No space left"):
        io.save_checkpoint(str(tmp_path), 3, tensors, {"training": {"completed": 3}})
    assert set(tmp_path.rglob("*.tmp-*")) == set(mine)


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: each falls back to an older intact one, loudly, or fails clearly.

@pytest.fixture
def two_checkpoints(tmp_path):
    train(tiny(tmp_path, "checkpoints.checkpoint_interval=4"), until_step=8, out=quiet())
    return tmp_path


def damage_truncate(run):
    f = run / "8" / "model" / "rank00000.safetensors"
    f.write_bytes(f.read_bytes()[:100])


def damage_flip(run):
    f = run / "8" / "optimizer" / "rank00000.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def damage_metadata_missing(run):
    (run / "8" / "checkpoint_metadata.json").unlink()


def damage_metadata_garbage(run):
    (run / "8" / "checkpoint_metadata.json").write_text("{not json")


def damage_latest_nowhere(run):
    (run / "latest.txt").write_text("999\n")


def damage_latest_garbage(run):
    (run / "latest.txt").write_text("\x00\x01 garbage")


def damage_latest_superscript(run):
    (run / "latest.txt").write_text("\u00b2\n")                # "²": str.isdigit says yes, int() says no


def damage_latest_huge(run):
    (run / "latest.txt").write_text("9" * 5000 + "\n")         # more digits than int() converts


def sealed_again(run, change):
    """Step 8's marker rewritten as change(its contents) and sealed again: a valid seal over a wrong shape."""
    path = run / "8" / "checkpoint_metadata.json"
    meta = json.loads(path.read_text())
    meta.pop("metadata_xxh3_128")
    path.write_bytes(sealed(change(meta)))


def damage_metadata_bit_flip(run):      # "completed": 8 becomes 9 — one bit, still valid JSON
    path = run / "8" / "checkpoint_metadata.json"
    data = bytearray(path.read_bytes())
    at = data.index(b'"completed": 8') + len(b'"completed": ')
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


MARKER_DAMAGE = {  # name: (damage, what the warning says)
    "a flipped bit": (damage_metadata_bit_flip, "its contents differ from the checksum it was sealed with"),
    "another step's marker": (lambda run: (run / "8" / "checkpoint_metadata.json").write_bytes(
        (run / "4" / "checkpoint_metadata.json").read_bytes()), "it records step 4, in folder 8"),
    "format only": (lambda run: (run / "8" / "checkpoint_metadata.json").write_text(json.dumps({"format": FORMAT})),
                    "damaged: no metadata_xxh3_128"),
    "an older format": (lambda run: (run / "8" / "checkpoint_metadata.json").write_text(json.dumps(
        {"format": "nanoflow-checkpoint/2", "step": 8})), "is a nanoflow-checkpoint/2 checkpoint; this nanoflow reads"),
    "files: []": (lambda run: sealed_again(run, lambda m: {**m, "files": []}), '"files" lists no files'),
    "no tensors": (lambda run: sealed_again(run, lambda m: {k: v for k, v in m.items() if k != "tensors"}),
                   '"tensors" lists no tensors'),
    "no training": (lambda run: sealed_again(run, lambda m: {k: v for k, v in m.items() if k != "training"}),
                    '"training" does not say'),
    "sizes as text": (lambda run: sealed_again(run, lambda m: {**m, "files": {
        n: {**e, "bytes": str(e["bytes"])} for n, e in m["files"].items()}}), "has no byte count"),
    "step 9 in folder 8": (lambda run: sealed_again(run, lambda m: {**m, "step": 9}),
                           '"step" is 9 but "training" says 8'),
}


@pytest.mark.parametrize("name", MARKER_DAMAGE)
def test_a_malformed_marker_is_damage_and_the_older_intact_checkpoint_is_restored(two_checkpoints, name):
    damage, reason = MARKER_DAMAGE[name]
    damage(two_checkpoints)
    with logged() as warned:
        assert io.latest(str(two_checkpoints)) == f"{two_checkpoints}/4"
    assert any(reason in w for w in warned), warned
    out = quiet()
    state = restore(tiny(two_checkpoints), out=out)
    assert state.step == 4 and reason in out.getvalue(), out.getvalue()
    reference = io.read_checkpoint(str(two_checkpoints / "4"))
    for name, p in state.model.named_parameters():
        assert torch.equal(reference.groups["model"][name], p), name
    with pytest.raises(io.DamagedCheckpointError, match=re.escape(reason)):   # named on its own: the error
        io.read_checkpoint(str(two_checkpoints / "8"))


def test_latest_txt_naming_an_older_step_than_the_last_commit_gives_way_with_a_warning(two_checkpoints):
    (two_checkpoints / "latest.txt").write_text("4\n")         # as a kill between 8's commit and latest.txt leaves it
    with logged() as warned:
        assert io.latest(str(two_checkpoints)) == f"{two_checkpoints}/8"
    assert any("names step 4, but step 8 was committed after it" in w for w in warned), warned


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip, damage_metadata_missing, damage_metadata_garbage])
def test_damaged_latest_falls_back_to_the_newest_intact(two_checkpoints, damage):
    damage(two_checkpoints)
    out = quiet()
    state = restore(tiny(two_checkpoints), out=out)
    assert state.step == 4
    assert "warning:" in out.getvalue() and "/8" in out.getvalue()
    reference = io.read_checkpoint(str(two_checkpoints / "4"))
    for name, p in state.model.named_parameters():
        assert torch.equal(reference.groups["model"][name], p), name


@pytest.mark.parametrize("damage", [damage_latest_nowhere, damage_latest_garbage, damage_latest_superscript,
                                    damage_latest_huge])
def test_bad_latest_pointer_falls_back_to_the_newest_intact(two_checkpoints, damage):
    damage(two_checkpoints)
    with logged() as warned:
        assert io.latest(str(two_checkpoints)) == f"{two_checkpoints}/8"
    assert any("latest.txt" in w for w in warned), warned
    state = restore(tiny(two_checkpoints), out=quiet())
    assert state.step == 8


def test_a_damaged_step_folder_named_explicitly_is_refused(two_checkpoints):
    damage_flip(two_checkpoints)
    with pytest.raises(io.CheckpointError, match="damaged"):
        io.read_checkpoint(str(two_checkpoints / "8"))


def test_committed_checkpoints_none_intact_never_mean_a_fresh_start(two_checkpoints):
    for step in ("4", "8"):
        f = two_checkpoints / step / "model" / "rank00000.safetensors"
        f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(io.DamagedCheckpointError, match="(?s)none is intact.*pass --fresh"):
        restore(tiny(two_checkpoints), out=quiet())
    assert restore(tiny(two_checkpoints), fresh=True, out=quiet()).step == 0   # asked for: it may


def test_a_fresh_run_keeps_its_own_checkpoints_not_the_abandoned_runs_higher_steps(tmp_path):
    train(tiny(tmp_path, "tokens.train_steps=8", "checkpoints.checkpoint_interval=2"), out=quiet())
    abandoned = {step: io.read_metadata(str(tmp_path / str(step)))["created"] for step in (2, 4, 6, 8)}
    train(tiny(tmp_path, "tokens.train_steps=4", "checkpoints.checkpoint_interval=2", "checkpoints.keep=2"),
          fresh=True, out=quiet())
    # keep = 2 counts the most recently committed: the new run's 2 and 4; the old 6 and 8 went first.
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 4]
    assert all(io.read_metadata(str(tmp_path / str(step)))["created"] > abandoned[8] for step in (2, 4))
    assert io.checkpoints_to_try(str(tmp_path)) == [f"{tmp_path}/4", f"{tmp_path}/2"]


def test_after_latest_the_most_recently_committed_is_tried_first(tmp_path):
    train(tiny(tmp_path, "tokens.train_steps=8", "checkpoints.checkpoint_interval=4"), out=quiet())   # 4, 8
    train(tiny(tmp_path, "tokens.train_steps=8", "checkpoints.checkpoint_interval=2"),
          fresh=True, until_step=2, out=quiet())                                  # a fresh run, stopped after 2
    assert io.checkpoints_to_try(str(tmp_path)) == [f"{tmp_path}/2", f"{tmp_path}/8", f"{tmp_path}/4"]
    (tmp_path / "latest.txt").unlink()                                           # no pointer: commit order alone
    assert io.checkpoints_to_try(str(tmp_path))[0] == f"{tmp_path}/2"


def test_every_marker_lost_under_latest_txt_stops_the_run_naming_its_step(two_checkpoints):
    # A sync that dropped *.json: latest.txt says step 8 was committed, but no step folder holds a marker. That is
    # a run's history lost, never "nothing here": a start from scratch would delete the old tensor files.
    for step in ("4", "8"):
        (two_checkpoints / step / "checkpoint_metadata.json").unlink()
    tensors = {p: p.read_bytes() for p in two_checkpoints.rglob("*.safetensors")}
    with pytest.raises(io.DamagedCheckpointError, match=r"(?s)latest\.txt names step 8.*8 is incomplete.*pass --fresh"):
        restore(tiny(two_checkpoints), out=quiet())
    with pytest.raises(io.DamagedCheckpointError, match=r"latest\.txt names step 8"):
        io.latest(str(two_checkpoints))
    with pytest.raises(io.CheckpointError):
        train(tiny(two_checkpoints), out=quiet())
    assert {p: p.read_bytes() for p in two_checkpoints.rglob("*.safetensors")} == tensors


def test_incomplete_folders_without_latest_txt_are_no_checkpoint(two_checkpoints):
    # No latest.txt: nothing says a step was ever committed (the first saves of a run killed mid-write).
    for step in ("4", "8"):
        (two_checkpoints / step / "checkpoint_metadata.json").unlink()
    (two_checkpoints / "latest.txt").unlink()
    assert io.latest(str(two_checkpoints)) is None
    with pytest.raises(io.CheckpointError):
        io.read_checkpoint(str(two_checkpoints))


# ---------------------------------------------------------------------------------------------
# Real processes: SIGTERM saves and exits; kill -9 anywhere, even mid-write, loses nothing committed.


def test_explicit_resume_path_without_a_checkpoint_is_an_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    config = tiny(tmp_path / "run", f'checkpoints.resume_checkpoint_path="{tmp_path / "empty"}"')
    with pytest.raises(io.CheckpointError, match="holds no committed checkpoint"):
        restore(config, out=quiet())
    result = run_in_process("train", *train_args(tmp_path / "run", f'checkpoints.resume_checkpoint_path="{tmp_path / "empty"}"'),
                            capsys=capsys)
    assert result.returncode == 2
    assert "holds no committed checkpoint" in result.stderr and "Traceback" not in result.stderr
