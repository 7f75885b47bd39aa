"""The local run folder at start-up: a file, read-only, an unwritable metrics.jsonl, a full disk — each a clear
error naming the path before training (exit status 2), never a traceback; TensorBoard failing never stops a run."""

import contextlib
import io as text_io
import os
import subprocess
from pathlib import Path

import pytest
from helpers import TINY
from log_helpers import logged
from process_helpers import bin_command, run_command, train_args

from nanoflow import io, load_config
from nanoflow.config import ConfigError
from nanoflow.errors import StorageLostError
from nanoflow.io.runfolder import RunFolderError
from nanoflow.observe.tensorboard import TensorBoardLog, available
from nanoflow.training.loop import train


def train_command(run: Path, *overrides: str) -> list[str]:
    return bin_command("train", *train_args(run, *overrides))


def run_train(run: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_command("train", *train_args(run, *overrides), timeout=600)


def mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount here (mount {' '.join(args)}: {result.stderr.strip()})")


@contextlib.contextmanager
def read_only(path: Path):
    """`path` (a file or folder) made unwritable: by a read-only bind mount as root (root ignores file modes),
    by its mode otherwise."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    mount("--bind", str(path), str(path))
    try:
        mount("-o", "remount,bind,ro", str(path))
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


@contextlib.contextmanager
def small_disk(path: Path, size: str = "2m"):
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(disk: Path) -> None:
    with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()


def test_checkpoints_path_that_is_a_file_is_refused_before_anything(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("my notes")
    result = run_train(path)
    assert result.returncode == 2, result.stderr
    assert f"checkpoints.checkpoints_path = {path} is a file, not a folder" in result.stderr
    assert "Traceback" not in result.stderr and path.read_text() == "my notes"


@pytest.mark.slow
def test_a_read_only_run_folder_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    train(load_config(TINY, [f'checkpoints.checkpoints_path="{run}"']), until_step=4, out=text_io.StringIO())
    before = sorted(p.name for p in run.rglob("*"))
    with read_only(run):
        result = run_train(run)
        finished = run_train(run, "tokens.train_steps=4")   # even finished: its lock cannot be taken
    for refused in (result, finished):
        assert refused.returncode == 2, refused.stderr
        assert f"cannot create the run lock {run}/nanoflow.lock: Read-only file system" in refused.stderr
        assert "Traceback" not in refused.stderr
    assert "step  5" not in result.stdout and sorted(p.name for p in run.rglob("*")) == before


@pytest.mark.slow
def test_an_unwritable_metrics_jsonl_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    train(load_config(TINY, [f'checkpoints.checkpoints_path="{run}"']), until_step=4, out=text_io.StringIO())
    metrics = run / "metrics.jsonl"
    with read_only(metrics):
        result = run_train(run)
        with pytest.raises(RunFolderError, match=f"cannot write {metrics}"):
            train(load_config(TINY, [f'checkpoints.checkpoints_path="{run}"']), out=text_io.StringIO())
    assert result.returncode == 2, result.stderr
    assert f"cannot write {metrics}" in result.stderr and "Traceback" not in result.stderr
    assert io.read_metadata(str(run))["step"] == 4    # nothing trained, nothing saved


@pytest.mark.slow
def test_a_full_disk_on_a_rerun_is_a_clear_error_before_training(tmp_path):
    disk = tmp_path / "disk"
    with small_disk(disk):
        run = disk / "run"
        assert run_train(run, "tokens.train_steps=4").returncode == 0
        fill(disk)
        result = run_train(run)
        assert result.returncode == 2, result.stderr
        assert f"cannot write the run lock {run}/nanoflow.lock: No space left on device" in result.stderr
        assert "Traceback" not in result.stderr and io.read_metadata(str(run))["step"] == 4


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_says_the_commit_stands(tmp_path):
    disk = tmp_path / "disk"
    with small_disk(disk, "1m"):
        run = disk / "run"
        # About three checkpoints' room: the saves at steps 1, 2, ... fill the disk until one cannot be written.
        result = run_train(run, "checkpoints.checkpoint_interval=1")
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert "No space left on device" in result.stderr
        assert "run the same command again" in result.stderr
        committed = io.read_metadata(str(run))["step"]
        assert committed >= 1
        io.read_checkpoint(str(run))   # what was committed is whole


@pytest.mark.skipif(not available(), reason="tensorboard is not installed")
def test_tensorboard_failing_stops_tensorboard_not_the_run(tmp_path, capfd):
    with small_disk(tmp_path / "disk", "64k"), logged() as warnings:
        fill(tmp_path / "disk")
        with TensorBoardLog(tmp_path / "disk", 0) as log:
            log.write({"step": 1, "stage": "s", "loss": 1.0, "lr": 0.1, "grad_norm": 1.0})
    assert len(warnings) == 1 and "TensorBoard logging stopped" in warnings[0] and "No space left" in warnings[0]
    assert "Traceback" not in capfd.readouterr().err


def test_metrics_write_failing_mid_run_is_a_storage_error(tmp_path):
    from nanoflow.errors import EXIT_STORAGE
    from nanoflow.observe.metrics import MetricsLog

    with small_disk(tmp_path / "disk", "64k"):
        path = tmp_path / "disk" / "metrics.jsonl"
        with MetricsLog(path, 0) as log:
            fill(tmp_path / "disk")
            with pytest.raises(StorageLostError, match=f"cannot write {path} after step 3: No space left") as error:
                log.write({"step": 3, "loss": 1.0})
    assert error.value.exit_status == EXIT_STORAGE and "run the same command again" in str(error.value)


# ---------------------------------------------------------------------------------------------
# Nothing outside the run folder, nothing lost without a word

@pytest.mark.parametrize("name", ["../../x", "/tmp/elsewhere", "a/b", "..", ".", ""])
def test_a_run_name_that_is_no_plain_name_is_refused_by_key(tmp_path, name):
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, [f"checkpoints.checkpoints_path={str(tmp_path / 'run')!r}", f"general.run={name!r}"])
    assert "general.run" in str(refused.value), refused.value
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["checkpoints.checkpoints_path", "checkpoints.resume_checkpoint_path",
                                 "model.init_from"])
def test_an_empty_path_is_refused_by_key_never_taken_as_the_config_folder(tmp_path, key):
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, [f"checkpoints.checkpoints_path={str(tmp_path / 'run')!r}", f'{key}=""'])
    assert f"{key}: empty" in str(refused.value), refused.value


def test_fresh_keeps_the_old_runs_metrics_moved_aside_and_says_so(tmp_path):
    run = tmp_path / "run"
    train(load_config(TINY, [f"checkpoints.checkpoints_path={str(run)!r}", "tokens.train_steps=3"]),
          out=text_io.StringIO())
    old = (run / "metrics.jsonl").read_text()
    assert len(old.splitlines()) == 3
    out = text_io.StringIO()
    train(load_config(TINY, [f"checkpoints.checkpoints_path={str(run)!r}", "tokens.train_steps=2"]), fresh=True,
          out=out)
    assert (run / "metrics.1.jsonl").read_text() == old  # every row of the old run, as it was
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert f"{run / 'metrics.jsonl'} moved to {run / 'metrics.1.jsonl'}" in out.getvalue(), out.getvalue()


def test_a_symlinked_step_folder_is_resumed_from_and_never_written_through(tmp_path):
    run, disk = tmp_path / "run", tmp_path / "other-disk"
    config = load_config(TINY, [f"checkpoints.checkpoints_path={str(run)!r}", "tokens.train_steps=4",
                                "checkpoints.checkpoint_interval=2", "checkpoints.keep=1"])
    train(config, until_step=2, out=text_io.StringIO())
    disk.mkdir()
    (run / "2").rename(disk / "2")            # moved to another disk …
    (run / "2").symlink_to(disk / "2")        # … and linked back
    before = {p.name: p.read_bytes() for p in (disk / "2").rglob("*") if p.is_file()}
    out = text_io.StringIO()
    state = train(config, out=out)
    assert f"resuming from {run}/2: step 2 done" in out.getvalue(), out.getvalue()
    assert state.step == 4 and io.latest(str(run)) == f"{run}/4"
    # keep = 1 would delete step 2: not through a link nanoflow did not make
    assert {p.name: p.read_bytes() for p in (disk / "2").rglob("*") if p.is_file()} == before
    assert (run / "2").is_symlink()
