"""Nothing is written through a link nanoflow did not make, by any command (issue 30, item 7): a training save whose
step folder holds a `model/` linked elsewhere, bin/average into such a folder. Each stops with exit status 2 and
one line naming the link; the folder the link points to stays as it was."""

from __future__ import annotations

import json

import pytest
from helpers import TINY

from nanoflow import io
from nanoflow.commands.cli import average_main, train_main


def contents(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_never_writes_through_a_linked_folder_of_its_step_folder(tmp_path, capsys, async_save):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "4").mkdir(parents=True)
    (run / "4" / "model").symlink_to(elsewhere)
    sets = [f"checkpoints.checkpoints_path={json.dumps(str(run))}", "tokens.train_steps=4",
            "checkpoints.checkpoint_interval=2", f"checkpoints.async_save={str(async_save).lower()}"]
    assert train_main([str(TINY), *[a for s in sets for a in ("--set", s)]]) == 2
    err = one_line(capsys)
    assert f"{run}/4/model" in err and "symlink" in err, err
    assert contents(elsewhere) == {}
    assert io.latest(str(run)) == f"{run}/2"        # what was committed before stands


def test_average_never_writes_through_a_linked_folder_of_its_out_dir(run_dir, tmp_path, capsys):
    out, elsewhere = tmp_path / "avg", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "8").mkdir(parents=True)
    (out / "8" / "model").symlink_to(elsewhere)
    assert average_main([str(run_dir), str(out), "--last", "2"]) == 2
    err = one_line(capsys)
    assert f"{out}/8/model" in err and "symlink" in err, err
    assert contents(elsewhere) == {} and io.latest(str(out)) is None
