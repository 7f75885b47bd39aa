"""Resume across real processes: SIGTERM, and kill -9 mid-save and mid-training (tests/e2e/test_resume.py:
in-process)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, quiet, tiny
from process_helpers import bin_command, run_command, train_args

from nanoflow import io
from nanoflow.commands.verify import first_difference
from nanoflow.training.loop import train


def train_command(run: Path, *overrides: str) -> list[str]:
    return bin_command("train", *train_args(run, *overrides))


def save_size(run: Path) -> int:
    return sum(f["bytes"] for f in io.read_metadata(str(run))["files"].values())


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_says_how_to_resume(tmp_path, straight):
    reference, _ = straight
    process = subprocess.Popen(train_command(tmp_path, "checkpoints.checkpoint_interval=100"), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 600   # a hang guard: bin/train starts slowly on busy cores
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=600)
    assert process.returncode == 75, out   # EXIT_STOPPED: saved, not finished
    assert "stopped by SIGTERM" in out and "run the same command again" in out
    stopped_at = io.read_metadata(str(tmp_path))["step"]
    assert 2 <= stopped_at < 12
    assert run_command("train", *train_args(tmp_path), timeout=600).returncode == 0
    final = io.read_checkpoint(str(tmp_path))
    for name, p in reference.model.named_parameters():
        assert torch.equal(final.groups["model"][name], p), name


@pytest.mark.slow
def test_kill_9_mid_save_at_several_byte_offsets_then_resume_is_bit_identical(tmp_path, straight):
    _, reference_run = straight
    size = save_size(reference_run)
    run = tmp_path / "run"
    # Offsets inside the first save (step 2), in its model file, its optimizer file, its metadata and
    # latest.txt, then inside the second save; each kill is followed by a plain rerun of the same command.
    for offset in (0, 1000, size // 2, size - 10, size + 50, size + size // 3):
        env = {**os.environ, "NANOFLOW_KILL_AFTER_BYTES": str(offset)}
        killed = run_command("train", *train_args(run, "checkpoints.checkpoint_interval=2"), env=env, timeout=600)
        assert killed.returncode == -signal.SIGKILL
        committed = io.latest(str(run))
        if committed is not None:
            io.read_checkpoint(committed)  # whatever is committed is whole and loads
    finished = run_command("train", *train_args(run, "checkpoints.checkpoint_interval=2"), timeout=600)
    assert finished.returncode == 0, finished.stderr
    assert first_difference(io.read_checkpoint(str(reference_run)), io.read_checkpoint(str(run))) is None
    assert not list(run.rglob("*.tmp-*")), "temporary files of killed writes are cleaned up"


@pytest.mark.slow
def test_kill_9_mid_training_then_rerun_ends_bit_identical(tmp_path):
    # 250 steps, saved every 10: the kill comes after the saves of 10 and 20 with 225 steps still to go, a wide
    # margin against the run finishing before the kill lands.
    overrides = ("tokens.train_steps=250", "data_stages.sft.start_training_step=300",
                 "checkpoints.checkpoint_interval=10")
    train(tiny(tmp_path / "straight", *overrides), out=quiet(), progress=False)
    run = tmp_path / "run"
    process = subprocess.Popen(train_command(run, *overrides), cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 25):   # past the saves of 10, 20
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.005)
    process.kill()                                                  # SIGKILL, between two saves or inside one
    process.wait(timeout=600)
    committed = io.read_metadata(str(run))["step"]
    assert 20 <= committed < 250 and process.returncode == -signal.SIGKILL
    rerun = run_command("train", *train_args(run, *overrides), timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming from {run}/{committed}: step {committed} done" in rerun.stdout
    assert first_difference(io.read_checkpoint(str(tmp_path / "straight")), io.read_checkpoint(str(run))) is None
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 251))                             # the killed attempt's extra lines are gone
