"""The WSD-vs-cosine study reduced to a few steps of a tiny model, end to end through bin/sweep's run_study: the
trunk is trained once, each branch begins from the trunk's committed bytes, every run is evaluated at the same
steps, and a rerun of the study trains nothing (tests/unit/test_study.py: the study file's checks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from run_helpers import assert_same_checkpoint, folder_digest
from support.study import BASE, SMALL

from nanoflow.commands.cli import compare_main, train_main
from nanoflow.commands.compare import format_table, read_runs
from nanoflow.commands.sweep import run_study
from nanoflow.errors import EXIT_DONE

STEPS, EVERY, AT = 8, 4, 4   # budget, eval interval, branch point


def study_file(tmp_path: Path) -> Path:
    """The study's shape (a trunk, a 1-sqrt and a linear cooldown branch, a cosine baseline, an average) in
    small, plus a branch that keeps the trunk's constant LR: it must end equal to the trunk."""
    cooldown = "data_stages.cooldown.learning_rate_scheduler.lr_decay_style"
    runs = [("trunk", None, [f"tokens.train_steps={STEPS}"]),
            ("wsd-1sqrt", AT, [f"tokens.train_steps={STEPS}", f'{cooldown}="1-sqrt"']),
            ("wsd-linear", AT, [f"tokens.train_steps={STEPS}", f'{cooldown}="linear"']),
            ("continued", AT, [f"tokens.train_steps={STEPS}", "data_stages.cooldown.start_training_step=100000"]),
            ("cosine", None, [f"tokens.train_steps={STEPS}",
                              'optimizer.learning_rate_scheduler.lr_decay_style="cosine"'])]
    text = f"base = {json.dumps(str(BASE))}\nruns_dir = \"runs\"\n"
    for name, at, sets in runs:
        text += f"\n[[runs]]\nname = \"{name}\"\n"
        if at is not None:
            text += f"branch = {{from = \"trunk\", at = {at}}}\n"
        text += f"set = {json.dumps(SMALL + sets)}\n"
    text += "\n[[averages]]\nname = \"trunk-avg\"\nrun = \"trunk\"\nsteps = [4, 6, 8]\n"
    path = tmp_path / "study.toml"
    path.write_text(text)
    return path


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def metadata(step_folder: Path) -> dict:
    return json.loads((step_folder / "checkpoint_metadata.json").read_text())


@pytest.mark.slow
def test_the_reduced_study_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    study = study_file(tmp_path)
    assert run_study(str(study), train_main=train_main) == EXIT_DONE
    table = capsys.readouterr().out
    runs = tmp_path / "runs"
    branches = ["wsd-1sqrt", "wsd-linear", "continued"]

    # The trunk is trained once: each of its steps one metrics row; a branch trains only the steps after its point.
    assert [m["step"] for m in rows(runs / "trunk" / "metrics.jsonl")] == list(range(1, STEPS + 1))
    for name in branches:
        assert [m["step"] for m in rows(runs / name / "metrics.jsonl")] == list(range(AT + 1, STEPS + 1)), name
    assert [m["step"] for m in rows(runs / "cosine" / "metrics.jsonl")] == list(range(1, STEPS + 1))

    # Each branch began from the trunk's step folder, and restored its bytes: the branch that keeps the trunk's
    # LR commits the trunk's tensors (model and optimizer) at every step after the branch point.
    for name in branches:
        first = min(int(p.name) for p in (runs / name).iterdir() if p.name.isdigit())
        assert first == AT + 2
        lineage = metadata(runs / name / str(first))["lineage"]
        assert Path(lineage["began_from"]) == runs / "trunk" / str(AT) and lineage["began_at"] == AT, lineage
    for step in (6, 8):
        assert_same_checkpoint(runs / "continued" / str(step), runs / "trunk" / str(step))
    # ... while a cooldown really decays: its weights leave the trunk's.
    with pytest.raises(AssertionError):
        assert_same_checkpoint(runs / "wsd-1sqrt" / str(STEPS), runs / "trunk" / str(STEPS))

    # Every run (the average too) has both eval sets at the same steps, from its start on.
    eval_sets = {"prose", "glossary"}
    for name, began in [("trunk", 0), ("cosine", 0), *((b, AT) for b in branches), ("trunk-avg", STEPS - 1)]:
        got = {}
        for row in rows(runs / name / "eval.jsonl"):
            got.setdefault(row["step"], set()).add(row["dataset"])
        assert got == {s: eval_sets for s in range(EVERY, STEPS + 1, EVERY) if s > began}, (name, got)

    assert "cosine" in table and "wsd-1sqrt" in table and (runs / "compare.png").stat().st_size > 0

    # A rerun trains nothing new: every run is passed over, no file of any run folder changes.
    before = {name: folder_digest(runs / name) for name in ["trunk", "cosine", "trunk-avg", *branches]}
    assert run_study(str(study), train_main=train_main) == EXIT_DONE
    after = {name: folder_digest(runs / name) for name in before}
    for name in before:
        changed = {f for f in set(before[name]) | set(after[name]) if before[name].get(f) != after[name].get(f)}
        assert not changed, (name, changed)

    # The study moved elsewhere and named by relative paths: bin/compare still finds the trunk of each branch and
    # of the average (their records name the old folder) and prints the very table the study printed.
    names = ["trunk", *branches, "cosine", "trunk-avg"]
    expected = format_table(read_runs([str(runs / name) for name in names]))
    assert expected in table and "saved" in expected
    shutil.copytree(runs, tmp_path / "moved")
    shutil.rmtree(runs)
    monkeypatch.chdir(tmp_path / "moved")
    capsys.readouterr()
    assert compare_main([*names, "--output", "c.png"]) == EXIT_DONE
    assert expected in capsys.readouterr().out

