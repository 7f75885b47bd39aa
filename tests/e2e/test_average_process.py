"""Averaging checkpoints on S3 and a dp=2 × tp=2 run trained under torchrun (the rest: tests/unit/test_average.py)."""

from __future__ import annotations

import pytest
from helpers import quiet, tiny
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
