"""bin/sweep's study file: a study of the wrong shape is one line naming the key, before anything runs (the study
itself, end to end: tests/e2e/test_study_runs.py)."""

from __future__ import annotations

import json

import pytest
from support.study import BASE

from nanoflow.commands.cli import sweep_main

# ---------------------------------------------------------------------------------------------
# Issue 30, items 12 and 8: a study file of the wrong shape is one line naming the key, before anything runs;
# average names obey the rules run names obey.

RUN = '[[runs]]\nname = "trunk"\nset = ["tokens.train_steps=4"]\n'
TOP = f'base = {json.dumps(str(BASE))}\nruns_dir = "runs"\n'


@pytest.mark.parametrize("text, words", [
    (TOP + 'runs = "x"\n', "runs: [[runs]] tables"),
    (TOP + '[runs]\nname = "trunk"\n', "runs: [[runs]] tables"),
    (TOP, "no [[runs]]"),
    (TOP + RUN + '[[runs]]\nname = "b"\nbranch = "trunk"\n', "runs[1].branch"),
    (TOP + RUN + '[[runs]]\nname = "b"\nbranch = {from = "trunk", at = true}\n', "runs[1].branch.at"),
    (TOP + '[[runs]]\nname = "trunk"\nset = [1]\n', "runs[0].set"),
    (TOP + '[[runs]]\nname = "../x"\n', "runs[0].name"),
    (TOP + '[[runs]]\nnmae = "trunk"\n', "runs[0].nmae: unknown key (did you mean 'name'?)"),
    (TOP + RUN + '[[avrages]]\nname = "avg"\nrun = "trunk"\nlast = 2\n', "did you mean 'averages'?"),
    (TOP + RUN + '[[averages]]\nname = "trunk"\nrun = "trunk"\nlast = 2\n', "averages[0].name = 'trunk'"),
    (TOP + RUN + '[[averages]]\nname = "a"\nrun = "trunk"\nlast = 2\n[[averages]]\nname = "a"\nrun = "trunk"\nlast = 1\n',
     "averages[1].name = 'a'"),
    (TOP + RUN + '[[averages]]\nname = "../outside"\nrun = "trunk"\nlast = 2\n', "averages[0].name = '../outside'"),
    (TOP + RUN + '[[averages]]\nname = ""\nrun = "trunk"\nlast = 2\n', "averages[0].name = ''"),
    (TOP + RUN + '[[averages]]\nname = "a"\nrun = "trunk"\n', "averages[0]: one of last"),
    (TOP + RUN + '[[averages]]\nname = "a"\nrun = "trunk"\nsteps = [2, 4]\nweights = [1]\n', "averages[0].weights"),
    (TOP + RUN + 'figure = 3\n', "figure"),
])
def test_a_study_of_the_wrong_shape_is_one_line_naming_the_key(tmp_path, capsys, text, words):
    study = tmp_path / "study.toml"
    study.write_text(text)
    assert sweep_main([str(study)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {study}: ") and words in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "outside").exists()


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes(b'base = "\xff"\n'), "not UTF-8"),
    (lambda p: p.mkdir(), "is a folder"),
])
def test_a_study_file_that_cannot_be_read_as_text_is_one_line(tmp_path, capsys, make, words):
    make(tmp_path / "study.toml")
    assert sweep_main([str(tmp_path / "study.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_only_naming_no_run_of_the_study_is_refused(tmp_path, capsys):
    study = tmp_path / "study.toml"
    study.write_text(TOP + RUN)
    assert sweep_main([str(study), "--only", "trnk"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--only trnk" in err and "'trunk'" in err, err
