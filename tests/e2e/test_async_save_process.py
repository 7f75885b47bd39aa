"""The background save in real processes: a full disk, kill -9 mid-write, dp=2 under torchrun (in-process:
tests/e2e/test_async_save.py)."""

import os
import signal
import subprocess

import pytest
from process_helpers import run_command, run_layout, train_args
from support.async_save import ASYNC, committed_steps, comparable_metadata

from nanoflow import io
from nanoflow.commands.verify import first_difference
from nanoflow.errors import EXIT_STORAGE


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
        failed = run_command("train", *train_args(run, ASYNC), timeout=600)
        assert failed.returncode == EXIT_STORAGE, failed.stdout + failed.stderr
        assert "Traceback" not in failed.stderr
        assert "the checkpoint of step 8 could not be written" in failed.stderr, failed.stderr
        assert "No space left on device" in failed.stderr
        assert committed_steps(run) == [4] and (run / "latest.txt").read_text() == "4\n"
        assert not list(run.rglob("*.tmp-*")), "a failed write leaves no temporary behind"
        # Room again, and the same command resumes from step 4 and ends as the straight run.
        subprocess.run(["mount", "-o", f"remount,size={size * 10}", str(run)], check=True)
        rerun = run_command("train", *train_args(run, ASYNC), timeout=600)
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
    killed = run_command("train", *train_args(tmp_path, *overrides), env=env, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "saved step 2:" in killed.stdout and "saved step 4" not in killed.stdout
    assert committed_steps(tmp_path) == [2] and io.latest(str(tmp_path)) == f"{tmp_path}/2"
    assert list((tmp_path / "4").rglob("*.tmp-*")), "the kill came inside a write of step 4's files"
    rerun = run_command("train", *train_args(tmp_path, *overrides), timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming from {tmp_path}/2: step 2 done" in rerun.stdout
    assert first_difference(io.read_checkpoint(str(reference_run)), io.read_checkpoint(str(tmp_path))) is None
    assert not list(tmp_path.rglob("*.tmp-*")), "the killed write's temporaries are cleaned up"


@pytest.mark.slow
def test_dp2_under_torchrun_ends_equal_to_a_sync_dp2_run(tmp_path, layout_run):
    sync = layout_run("dp2")   # the synchronous dp=2 run, shared with test_parallel
    result = run_layout("dp2", tmp_path / "async", ASYNC)
    assert result.returncode == 0, f"async:\n{result.stdout}\n{result.stderr}"
    assert committed_steps(sync) == committed_steps(tmp_path / "async") == [2, 4]
    for step in (2, 4):
        a, b = sync / str(step), tmp_path / "async" / str(step)
        assert first_difference(io.read_checkpoint(str(a)), io.read_checkpoint(str(b))) is None, step
        assert comparable_metadata(a) == comparable_metadata(b), step
