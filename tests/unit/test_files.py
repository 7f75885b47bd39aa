"""Nothing is written through a link nanoflow did not make (issue 30, item 7): every local writer — checkpoint
files, latest.txt, exports, the records a run appends to — goes through nanoflow.io.files, which refuses a link
below the folder the user named, a file that is a link and a planted temporary, and writes nothing anywhere."""

from __future__ import annotations

import os

import pytest

from nanoflow.errors import EXIT_BAD_INPUT, NanoflowError
from nanoflow.io.store import Store
from nanoflow.observe.metrics import MetricsLog


def contents(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def refused(work) -> NanoflowError:
    with pytest.raises(NanoflowError) as error:
        work()
    assert error.value.exit_status == EXIT_BAD_INPUT and "symlink" in str(error.value), error.value
    return error.value


def test_a_folder_below_the_root_that_is_a_link_is_never_written_into(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "4").mkdir(parents=True)
    (run / "4" / "model").symlink_to(elsewhere)          # a step folder's model/, linked to a folder elsewhere
    error = refused(lambda: Store(str(run)).write("4/model/rank00000.safetensors", b"weights"))
    assert f"{run}/4/model" in str(error)
    assert contents(elsewhere) == {} and (run / "4" / "model").is_symlink()


def test_a_file_that_is_a_link_is_refused_and_left_as_it_is(tmp_path):
    run, target = tmp_path / "run", tmp_path / "notes.txt"
    run.mkdir()
    target.write_text("the user's own file\n")
    (run / "latest.txt").symlink_to(target)
    error = refused(lambda: Store(str(run)).write("latest.txt", b"4\n"))
    assert f"{run}/latest.txt" in str(error) and str(target) in str(error)
    assert target.read_text() == "the user's own file\n" and (run / "latest.txt").is_symlink()
    assert sorted(p.name for p in run.iterdir()) == ["latest.txt"]   # no temporary left behind


def test_a_planted_temporary_is_not_written_through(tmp_path):
    run, target = tmp_path / "run", tmp_path / "target"
    run.mkdir()
    target.write_bytes(b"untouched")
    (run / f"eval.jsonl.tmp-{os.getpid()}").symlink_to(target)   # the very name this process writes first
    refused(lambda: Store(str(run)).write("eval.jsonl", b"{}\n"))
    assert target.read_bytes() == b"untouched" and not (run / "eval.jsonl").exists()


def test_the_root_the_user_named_may_itself_be_a_link(tmp_path):
    disk = tmp_path / "big-disk"
    disk.mkdir()
    (tmp_path / "runs").symlink_to(disk)                 # runs/ on another disk: the user's choice
    Store(str(tmp_path / "runs" / "x")).write("4/model/rank00000.safetensors", b"weights")
    assert (disk / "x" / "4" / "model" / "rank00000.safetensors").read_bytes() == b"weights"


def test_a_record_turned_into_a_link_after_the_run_opened_it_is_not_appended_through(tmp_path):
    path, target = tmp_path / "metrics.jsonl", tmp_path / "elsewhere.txt"
    target.write_text("")
    log = MetricsLog(path, 0)
    path.unlink()
    path.symlink_to(target)                              # planted between the check and the append
    with pytest.raises(NanoflowError, match="symlink"):
        with log:
            log.write({"step": 1, "loss": 1.0})
    assert target.read_text() == ""


