"""Averaging checkpoints on S3 and a dp=2 × tp=2 run trained under torchrun (the rest: tests/e2e/test_average.py)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, quiet, tiny
from process_helpers import run_command
from support.average import STAGES, assert_mean, mean_from_files

from nanoflow import io
from nanoflow.commands.cli import average_main
from nanoflow.io.store import Store
from nanoflow.training.loop import train


def test_s3_to_s3(run_dir, s3_bucket, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # an S3 run keeps its local record under ./runs/s3/…: here, not in the checkout
    source = f"{s3_bucket}/source"
    train(tiny(source, *STAGES, "tokens.train_steps=4"), out=quiet(), fresh=True)
    local = tmp_path / "copy"     # the source's bytes, for the expected mean
    store = Store(source)
    for path in store.objects():
        if path.partition("/")[0] in ("2", "4"):
            (local / path).parent.mkdir(parents=True, exist_ok=True)
            (local / path).write_bytes(store.read(path))
    out = f"{s3_bucket}/avg"
    assert average_main([source, out, "--last", "2"]) == 0
    assert_mean(out, mean_from_files([local / "2", local / "4"]))


@pytest.mark.slow
def test_a_dp2_tp2_checkpoint(tmp_path, layout_run):
    trained = layout_run("dp2tp2")          # torchrun, 4 gloo processes: checkpoints 2 and 4, sharded 2 × 2
    assert io.read_metadata(str(trained))["topology"] == {"dp": 2, "tp": 2, "world_size": 4}
    out = tmp_path / "avg"
    assert average_main([str(trained), str(out), "--last", "2"]) == 0
    assert_mean(out, mean_from_files([trained / "2", trained / "4"]))


# A bin/average held still between its save marker and its tensor files (issue 30, item 9): it marks the moment
# with the file argv[1], then waits until the test opens the FIFO argv[2] and closes it.
HELD_AVERAGE = """
import sys
import nanoflow.checkpoint.average as average
from nanoflow.commands.cli import average_main
real = average.write_files
def held(*args, **kwargs):
    open(sys.argv[1], "w").close()
    with open(sys.argv[2]) as fifo:
        fifo.read()
    return real(*args, **kwargs)
average.write_files = held
sys.exit(average_main(sys.argv[3:]))
"""


def release(fifo: Path, process: subprocess.Popen) -> None:
    """Let the held average go on: open its FIFO for writing (once it is waiting on it) and close it."""
    deadline = time.monotonic() + 120
    while True:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError as e:   # ENXIO: not open for reading yet
            if e.errno != errno.ENXIO or process.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_two_averages_into_one_out_dir_one_commits_the_other_is_refused(run_dir, tmp_path):
    out, ready, fifo = tmp_path / "avg", tmp_path / "ready", tmp_path / "go"
    os.mkfifo(fifo)
    first = subprocess.Popen([sys.executable, "-c", HELD_AVERAGE, str(ready), str(fifo), str(run_dir), str(out),
                              "--last", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.02)
        # The first holds OUT_DIR, mid-way: the second, into the same folder, is refused at once, writing nothing.
        second = run_command("average", run_dir, out, "--last", "3", cwd=tmp_path, timeout=600)
        release(fifo, first)
        stdout, stderr = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 0, stdout + stderr
    assert second.returncode == 2, second.stdout + second.stderr
    err = second.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and f"pid {first.pid}" in err, err
    assert [a["step"] for a in io.read_metadata(str(out))["averaged_from"]] == [6, 8]   # the first's, whole
    assert_mean(out, mean_from_files([run_dir / "6", run_dir / "8"]))
    # Once it is done, a third is refused too: the folder holds a committed average.
    third = run_command("average", run_dir, out, "--last", "3", cwd=tmp_path, timeout=600)
    assert third.returncode == 2 and "already holds a committed checkpoint" in third.stderr, third.stderr
