"""A marker that declares more tensor than its files hold (issue 30, item 15): re-sealed, so its seal checks out,
with one tensor's global shape grown to a petabyte. Every reader (export, average, eval, a resume) checks the
declared shapes against the bytes before it allocates anything, and calls the checkpoint damaged."""

from __future__ import annotations

import json
import shutil

import pytest

from nanoflow import io
from nanoflow.commands.cli import average_main, export_main
from nanoflow.errors import DamagedCheckpointError
from nanoflow.io.marker import SEAL, sealed

HUGE = 2 ** 48     # float32 elements: a PiB, more than any address space


def forged(run_dir, tmp_path, change) -> tuple:
    """A copy of run_dir whose step 8 marker was changed by change(meta) and sealed again."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    marker = copy / "8" / "checkpoint_metadata.json"
    meta = json.loads(marker.read_text())
    meta.pop(SEAL)
    change(meta)
    marker.write_bytes(sealed(meta))
    return copy, copy / "8"


def grown(meta) -> None:
    meta["tensors"]["model"]["model.norm.weight"]["shape"] = [HUGE]   # its one shard still [32] at [0]


def more_shards_than_bytes(meta) -> None:
    entry = meta["tensors"]["model"]["model.norm.weight"]
    shard = entry["shards"][0]
    entry["shape"] = [HUGE]    # covered, on paper, by its real shard and one more of HUGE - 32 elements in the same file
    entry["shards"].append({**shard, "key": "more", "offset": [32], "shape": [HUGE - 32]})


@pytest.mark.parametrize("change", [grown, more_shards_than_bytes])
def test_a_reader_refuses_declared_shapes_the_bytes_cannot_hold(run_dir, tmp_path, change):
    _, step = forged(run_dir, tmp_path, change)
    with pytest.raises(DamagedCheckpointError, match="model.norm.weight"):
        io.read_model(str(step))


def test_export_and_average_refuse_it_as_damaged_with_one_line(run_dir, tmp_path, capsys):
    run, step = forged(run_dir, tmp_path, grown)
    assert export_main([str(step), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "damaged" in err and "model.norm.weight" in err, err
    assert average_main([str(run), str(tmp_path / "avg"), "--steps", "6,8"]) == 2   # step 8 is no intact checkpoint
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step 8" in err, err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "avg").exists()
