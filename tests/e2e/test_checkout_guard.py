"""The guard that keeps the tests out of the user's checkout (tests/checkout_guard.py) sees what it must, on a
stand-in checkout in tmp_path: writes anywhere, reads of runs/ and hf/, through links, in subprocesses too."""

from __future__ import annotations

import os
import subprocess
import sys

import checkout_guard as guard

TOUCHES = """
import os, pathlib, shutil
c = pathlib.Path(os.environ["NANOFLOW_TEST_CHECKOUT"])
(c / "runs" / "tiny").mkdir()                             # wrote runs/tiny
(c / "runs" / "tiny" / "nanoflow.lock").write_text("x")   # wrote
sorted(os.listdir(c / "hf"))                              # read hf
(c / "schedules" / "tiny.toml").read_text()               # a committed file read: fine
(c / "nanoflow" / "__pycache__").mkdir()                  # Python's cache: fine
(c.parent / "elsewhere" / "out.txt").write_text("x")      # outside the checkout: fine
(c.parent / "elsewhere" / "link" / "model.bin").write_text("x")   # through a link into hf/: wrote
(c.parent / "elsewhere" / "gone" / "sub").mkdir(parents=True)
(c.parent / "elsewhere" / "gone" / "sub" / "0.txt").write_text("x")
os.chdir(c)                                               # rmtree names entries relative to descriptors, not to
shutil.rmtree(c.parent / "elsewhere" / "gone")            # the working directory: outside the checkout, fine
"""

def stand_in(tmp_path):
    checkout = tmp_path / "checkout"
    for folder in ("hf/tiny", "schedules", "nanoflow", "runs/curriculum"):
        (checkout / folder).mkdir(parents=True)
    (checkout / "schedules" / "tiny.toml").write_text("")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "link").symlink_to(checkout / "hf" / "tiny")
    return checkout


def test_a_subprocess_that_touches_the_checkout_is_reported_with_each_path(tmp_path):
    checkout, log = stand_in(tmp_path), tmp_path / "seen.tsv"
    env = {**os.environ, guard.CHECKOUT_VARIABLE: str(checkout), guard.LOG_VARIABLE: str(log),
           "PYTEST_CURRENT_TEST": "tests/test_x.py::test_y (call)"}
    before = guard.walk(str(checkout))
    subprocess.run([sys.executable, "-c", TOUCHES], env=env, check=True, timeout=600)
    seen = {tuple(line.split("\t")[1:]) for line in log.read_text().splitlines()}
    assert seen == {("wrote", "runs/tiny"), ("wrote", "runs/tiny/nanoflow.lock"), ("read", "hf"),
                    ("wrote", "hf/tiny/model.bin")}, seen
    assert guard.changed(before, guard.walk(str(checkout))) == ["new: hf/tiny/model.bin",
                                                               "new: runs/tiny/nanoflow.lock"]


def test_reads_of_the_quickstart_run_are_allowed_to_the_curriculum_test_only(tmp_path):
    checkout = stand_in(tmp_path)
    seen = guard.Guard(str(checkout))
    metadata = str(checkout / "runs" / "curriculum" / "checkpoint_metadata.json")
    for test, mode in [("tests/e2e/test_curriculum_skill.py::test_z (call)", "r"),
                       ("tests/e2e/test_curriculum_skill.py::test_z (call)", "w"),
                       ("tests/e2e/test_s3.py::test_w (call)", "r")]:
        os.environ["PYTEST_CURRENT_TEST"], saved = test, os.environ.get("PYTEST_CURRENT_TEST")
        try:
            seen.hook("open", (metadata, mode, 0))
        finally:
            os.environ["PYTEST_CURRENT_TEST"] = saved or ""
    found = [(t.split("::")[0], what) for t, what, _ in seen.found]
    assert found == [("tests/e2e/test_curriculum_skill.py", "wrote"), ("tests/e2e/test_s3.py", "read")]


def test_the_session_walk_names_each_file_made_changed_or_gone(tmp_path):
    checkout = stand_in(tmp_path)
    (checkout / "hf" / "tiny" / "config.json").write_text("{}")
    (checkout / "README.md").write_text("a")
    before = guard.walk(str(checkout))
    (checkout / "hf" / "tiny" / "config.json").unlink()
    (checkout / "README.md").write_text("ab")
    (checkout / "runs" / "curriculum" / "nanoflow.lock").write_text("")
    (checkout / "nanoflow" / "__pycache__").mkdir()
    (checkout / "nanoflow" / "__pycache__" / "x.pyc").write_text("")
    assert guard.changed(before, guard.walk(str(checkout))) == [
        "changed: README.md", "gone: hf/tiny/config.json", "new: runs/curriculum/nanoflow.lock"]
