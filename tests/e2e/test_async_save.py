"""[checkpoints] async_save: checkpoints written by a background thread while training goes on, committed
with the same protocol — the same bytes as a synchronous save, nothing committed lost to a kill or a failed
write, and a stop or the run's end waits for the save in flight."""

import os
import signal
import threading

import pytest
import torch
from helpers import quiet, tiny
from run_helpers import assert_same_training_state, folder_digest
from support.async_save import ASYNC, committed_steps, comparable_metadata

from nanoflow import io
from nanoflow.build import stage_data
from nanoflow.checkpoint.checkpointer import Checkpointer, StorageLostError
from nanoflow.commands.verify import first_difference
from nanoflow.errors import EXIT_STORAGE
from nanoflow.io.marker import METADATA
from nanoflow.io.store import Store, StoreError
from nanoflow.step import train_step
from nanoflow.training.loop import train


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
        assert release.wait(300)
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
            assert writing.wait(300)
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
    """Each step's write is held until the next save has been asked for (not for a fixed time, which a slow machine
    outlasts, so that the saves never meet and the test would assert nothing): the next one must wait for it."""
    import nanoflow.checkpoint.checkpointer as checkpointer_module

    real_write_files, real_save = checkpointer_module.write_files, checkpointer_module.Checkpointer.save
    asked = {step: threading.Event() for step in range(1, 14)}
    writing, most, overlapped = [], [0], []

    def save(self, state, **kwargs):
        asked[state.step].set()
        if writing:
            overlapped.append(state.step)   # asked while another save's files are still being written
        return real_save(self, state, **kwargs)

    def held_write_files(*args, **kwargs):
        step = args[1]
        writing.append(step)
        most[0] = max(most[0], len(writing))
        if step < 12:
            assert asked[step + 1].wait(300), f"the save of step {step + 1} was never asked for"
        try:
            return real_write_files(*args, **kwargs)
        finally:
            writing.remove(step)

    monkeypatch.setattr(checkpointer_module, "write_files", held_write_files)
    monkeypatch.setattr(checkpointer_module.Checkpointer, "save", save)
    state = train(tiny(tmp_path, ASYNC, "checkpoints.checkpoint_interval=1"), out=quiet(), progress=False)
    assert state.step == 12 and most[0] == 1 and overlapped == list(range(2, 13))
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


def test_a_stop_signal_waits_for_the_save_in_flight(straight, tmp_path, monkeypatch):
    """SIGTERM arrives while step 4's files are still being written: the run finishes the step, waits for
    step 4's commit, saves the step it stops after, and says so; both are committed, in that order."""
    import nanoflow.checkpoint.checkpointer as checkpointer_module
    import nanoflow.training.loop as loop_module

    reference, _ = straight
    real_write_files, real_save, real_train_step = \
        checkpointer_module.write_files, checkpointer_module.Checkpointer.save, loop_module.train_step
    finished, signalled, stop_save_asked = [], threading.Event(), threading.Event()

    def train_step(state, batch):
        # step 5 starts only once step 4's write has begun and sent the signal: a busy machine may start the
        # writer late, and the loop must not run on past step 5 (to step 8's save) before the signal lands
        if state.step == 4:
            assert signalled.wait(300), "step 4's write never began"
        return real_train_step(state, batch)

    def save(self, state, **kwargs):
        if state.step == 5:
            stop_save_asked.set()
        return real_save(self, state, **kwargs)

    def signalled_write_files(root, step, *args, **kwargs):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)   # handled by the main thread, which is held before step 5
            signalled.set()
            # held until the stop's own save has been asked for: however fast or slow the machine, the stop comes
            # while this write is still in flight, and has to wait for it
            assert stop_save_asked.wait(300), "the stop never asked for its save"
        written = real_write_files(root, step, *args, **kwargs)
        finished.append(step)
        return written

    monkeypatch.setattr(loop_module, "train_step", train_step)
    monkeypatch.setattr(checkpointer_module, "write_files", signalled_write_files)
    monkeypatch.setattr(checkpointer_module.Checkpointer, "save", save)
    out = quiet()
    state = train(tiny(tmp_path, ASYNC), out=out, progress=False)
    assert state.step == 5 and finished == [4, 5]
    text = out.getvalue()
    assert text.index("saved step 4:") < text.index("saved step 5:") < text.index("stopped by SIGTERM after step 5")
    assert committed_steps(tmp_path) == [4, 5] and (tmp_path / "latest.txt").read_text() == "5\n"
    resumed = train(tiny(tmp_path, ASYNC), out=quiet(), progress=False)
    assert_same_training_state(reference, resumed)


