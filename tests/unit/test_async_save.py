"""[checkpoints] async_save: checkpoints written by a background thread while training goes on, committed
with the same protocol — the same bytes as a synchronous save, nothing committed lost to a kill or a failed
write, and a stop or the run's end waits for the save in flight."""

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import quiet, tiny
from process_helpers import bin_command, run_command, run_layout, train_args
from run_helpers import assert_same_training_state, folder_digest

from nanoflow import io
from nanoflow.build import stage_data
from nanoflow.checkpoint.checkpointer import Checkpointer, StorageLostError
from nanoflow.errors import EXIT_STORAGE
from nanoflow.io.marker import METADATA, SEAL
from nanoflow.io.store import Store, StoreError
from nanoflow.training.loop import train
from nanoflow.step import train_step
from nanoflow.commands.verify import first_difference

ASYNC = "checkpoints.async_save=true"


def train_command(run: Path, *overrides: str) -> list[str]:
    return bin_command("train", *train_args(run, *overrides))


def comparable_metadata(step_folder: Path) -> dict:
    """A step's metadata without what differs between two runs of the same training: when it was committed (and
    so its seal) and where the run folder is, and whether it was saved asynchronously."""
    meta = json.loads((step_folder / METADATA).read_text())
    del meta["created"], meta[SEAL]
    del meta["config"]["checkpoints"]["checkpoints_path"], meta["config"]["checkpoints"]["async_save"]
    return meta


def committed_steps(run: Path) -> list[int]:
    return sorted(int(p.parent.name) for p in run.glob(f"*/{METADATA}"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """tiny's 12 steps, saved synchronously every 4 (steps 4, 8 and 12)."""
    run = tmp_path_factory.mktemp("straight")
    return train(tiny(run), out=quiet(), progress=False), run


def test_async_run_ends_equal_to_a_sync_run_with_identical_checkpoints(straight, tmp_path):
    reference, reference_run = straight
    out = quiet()
    state = train(tiny(tmp_path, ASYNC), out=out, progress=False)
    assert_same_training_state(reference, state)
    assert committed_steps(tmp_path) == committed_steps(reference_run) == [4, 8, 12]
    assert (tmp_path / "latest.txt").read_text() == "12\n"
    for step in (4, 8, 12):
        a, b = reference_run / str(step), tmp_path / str(step)
        assert comparable_metadata(a) == comparable_metadata(b), step
        tensors = {name: digest for name, digest in folder_digest(a).items() if name != METADATA}
        assert tensors == {name: digest for name, digest in folder_digest(b).items() if name != METADATA}, step
    assert [line.split(":")[0] for line in out.getvalue().splitlines() if line.startswith("saved step")] == \
        ["saved step 4", "saved step 8", "saved step 12"]


def test_save_copies_the_state_and_returns_while_the_files_are_written(tmp_path, monkeypatch):
    """save() returns before a byte of the tensors is written; training then changes the weights in place,
    and the checkpoint still holds the ones of the step saved."""
    import nanoflow.checkpoint.checkpointer as checkpointer_module

    release, writing = threading.Event(), threading.Event()
    real_write_files = checkpointer_module.write_files

    def held_write_files(*args, **kwargs):
        writing.set()
        assert release.wait(60)
        return real_write_files(*args, **kwargs)

    monkeypatch.setattr(checkpointer_module, "write_files", held_write_files)
    config = tiny(tmp_path, ASYNC)
    checkpointer = Checkpointer(config, out=quiet())
    with checkpointer.locked():
        state = checkpointer.restore()
        with stage_data(state) as loader:
            state, _ = train_step(state, loader.batch_at(1))
            saved = {name: p.detach().clone() for name, p in state.model.named_parameters()}
            assert checkpointer.save(state) is None
            assert writing.wait(60)
            assert checkpointer.poll() is None                       # not written yet: nothing committed
            assert not (tmp_path / "1" / METADATA).exists() and not (tmp_path / "latest.txt").exists()
            state, _ = train_step(state, loader.batch_at(2))          # training goes on meanwhile, in place
            assert any(not torch.equal(saved[n], p) for n, p in state.model.named_parameters())
        release.set()
        assert checkpointer.finish() == f"{tmp_path}/1"
    committed = io.read_checkpoint(str(tmp_path))
    assert committed.metadata["step"] == 1 and committed.metadata["training"]["completed"] == 1
    for name, p in saved.items():
        assert torch.equal(committed.groups["model"][name], p), name


def test_at_most_one_save_is_in_flight(tmp_path, monkeypatch):
    import nanoflow.checkpoint.checkpointer as checkpointer_module

    real_write_files, writing, most = checkpointer_module.write_files, [], [0]

    def slow_write_files(*args, **kwargs):
        writing.append(args[1])
        most[0] = max(most[0], len(writing))
        time.sleep(0.05)   # longer than a step of tiny: the next save comes while this one is written
        try:
            return real_write_files(*args, **kwargs)
        finally:
            writing.remove(args[1])

    monkeypatch.setattr(checkpointer_module, "write_files", slow_write_files)
    state = train(tiny(tmp_path, ASYNC, "checkpoints.checkpoint_interval=1"), out=quiet(), progress=False)
    assert state.step == 12 and most[0] == 1
    assert committed_steps(tmp_path) == list(range(1, 13))


def test_a_failed_background_write_is_raised_in_the_loop_naming_the_step(straight, tmp_path, monkeypatch):
    _, reference_run = straight
    real_write = Store.write

    def write(store, relative, chunks):
        if relative.startswith("8/optimizer/"):
            raise StoreError(f"cannot write {store.url(relative)}: [Errno 30] Read-only file system")
        return real_write(store, relative, chunks)

    monkeypatch.setattr(Store, "write", write)
    with pytest.raises(StorageLostError, match=r"the checkpoint of step 8 could not be written: StoreError: cannot "
                                               r"write .*/8/optimizer/.*Read-only file system") as caught:
        train(tiny(tmp_path, ASYNC), out=quiet(), progress=False)
    assert caught.value.exit_status == EXIT_STORAGE
    assert "the last committed checkpoint stands" in str(caught.value)
    assert committed_steps(tmp_path) == [4] and (tmp_path / "latest.txt").read_text() == "4\n"
    assert first_difference(io.read_checkpoint(str(reference_run / "4")), io.read_checkpoint(str(tmp_path))) is None


@pytest.mark.slow   # two bin/train processes
def test_a_full_disk_during_the_background_write_stops_the_run_and_a_rerun_ends_exact(straight, tmp_path):
    """A real full disk: a tmpfs with room for the first checkpoint and not the second."""
    reference, reference_run = straight
    run = tmp_path / "tmpfs"
    run.mkdir()
    size = sum(f.stat().st_size for f in (reference_run / "4").rglob("*") if f.is_file())
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(run)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        failed = run_command("train", *train_args(run, ASYNC), timeout=300)
        assert failed.returncode == EXIT_STORAGE, failed.stdout + failed.stderr
        assert "Traceback" not in failed.stderr
        assert "the checkpoint of step 8 could not be written" in failed.stderr, failed.stderr
        assert "No space left on device" in failed.stderr
        assert committed_steps(run) == [4] and (run / "latest.txt").read_text() == "4\n"
        assert not list(run.rglob("*.tmp-*")), "a failed write leaves no temporary behind"
        # Room again, and the same command resumes from step 4 and ends as the straight run.
        subprocess.run(["mount", "-o", f"remount,size={size * 10}", str(run)], check=True)
        rerun = run_command("train", *train_args(run, ASYNC), timeout=300)
        assert rerun.returncode == 0, rerun.stderr
        assert f"resuming from {run}/4: step 4 done" in rerun.stdout
        assert first_difference(io.read_checkpoint(str(reference_run)), io.read_checkpoint(str(run))) is None
    finally:
        subprocess.run(["umount", str(run)], capture_output=True)


@pytest.mark.slow   # two bin/train processes
def test_kill_9_mid_background_write_keeps_the_previous_commit_and_a_rerun_ends_exact(straight, tmp_path):
    _, reference_run = straight
    size = sum(entry["bytes"] for entry in io.read_metadata(str(reference_run / "4"))["files"].values())
    # With a save every 2 steps: step 2's save is committed, the kill comes halfway through step 4's files,
    # written by the background thread.
    overrides = (ASYNC, "checkpoints.checkpoint_interval=2")
    env = {**os.environ, "NANOFLOW_KILL_AFTER_BYTES": str(size + size // 2)}
    killed = run_command("train", *train_args(tmp_path, *overrides), env=env, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "saved step 2:" in killed.stdout and "saved step 4" not in killed.stdout
    assert committed_steps(tmp_path) == [2] and io.latest(str(tmp_path)) == f"{tmp_path}/2"
    assert list((tmp_path / "4").rglob("*.tmp-*")), "the kill came inside a write of step 4's files"
    rerun = run_command("train", *train_args(tmp_path, *overrides), timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming from {tmp_path}/2: step 2 done" in rerun.stdout
    assert first_difference(io.read_checkpoint(str(reference_run)), io.read_checkpoint(str(tmp_path))) is None
    assert not list(tmp_path.rglob("*.tmp-*")), "the killed write's temporaries are cleaned up"


def test_a_stop_signal_waits_for_the_save_in_flight(straight, tmp_path, monkeypatch):
    """SIGTERM arrives while step 4's files are still being written: the run finishes the step, waits for
    step 4's commit, saves the step it stops after, and says so; both are committed, in that order."""
    import nanoflow.checkpoint.checkpointer as checkpointer_module

    reference, _ = straight
    real_write_files, finished = checkpointer_module.write_files, []

    def signalled_write_files(root, step, *args, **kwargs):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)   # to the main thread, which is training step 5 by now
            time.sleep(1.0)                        # a slow write: the stop has to wait for it
        written = real_write_files(root, step, *args, **kwargs)
        finished.append(step)
        return written

    monkeypatch.setattr(checkpointer_module, "write_files", signalled_write_files)
    out = quiet()
    state = train(tiny(tmp_path, ASYNC), out=out, progress=False)
    assert state.step == 5 and finished == [4, 5]
    text = out.getvalue()
    assert text.index("saved step 4:") < text.index("saved step 5:") < text.index("stopped by SIGTERM after step 5")
    assert committed_steps(tmp_path) == [4, 5] and (tmp_path / "latest.txt").read_text() == "5\n"
    resumed = train(tiny(tmp_path, ASYNC), out=quiet(), progress=False)
    assert_same_training_state(reference, resumed)


@pytest.mark.slow
def test_dp2_under_torchrun_ends_equal_to_a_sync_dp2_run(tmp_path):
    for name, extra in (("sync", ()), ("async", (ASYNC,))):
        result = run_layout("dp2", tmp_path / name, *extra)
        assert result.returncode == 0, f"{name}:\n{result.stdout}\n{result.stderr}"
    assert committed_steps(tmp_path / "sync") == committed_steps(tmp_path / "async") == [2, 4]
    for step in (2, 4):
        a, b = tmp_path / "sync" / str(step), tmp_path / "async" / str(step)
        assert first_difference(io.read_checkpoint(str(a)), io.read_checkpoint(str(b))) is None, step
        assert comparable_metadata(a) == comparable_metadata(b), step
