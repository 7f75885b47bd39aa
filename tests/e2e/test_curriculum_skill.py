"""The default curriculum teaches what it says: held-out reversal exact match ≤ 10% before SFT, ≥ 90% after.

One real `bin/train schedules/curriculum.toml` (the Quickstart's command, its run folder moved into tmp_path):
under three minutes on two idle CPU cores, far more under load — the one expensive test of the suite. Where the
Quickstart's own run is there (runs/curriculum, as CI leaves it before the tests) and is this checkout's — the
whole schedule committed from this very config, by this torch, after the last change to any file of nanoflow/,
bin/ or schedules/ — its checkpoint and eval.jsonl are what is checked instead of training the same run again.
Measured on this schedule: 0.0% at the end of anneal (step 200), 81.5% at step 600, 99% at the end (step 800).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import REPO
from process_helpers import run_command, train_args

from nanoflow import io
from nanoflow.config import load_config
from nanoflow.evaluation import is_due
from nanoflow.io.marker import METADATA
from nanoflow.observe.metrics import read_eval
from nanoflow.schedule import Schedule, stage_steps

CURRICULUM = REPO / "schedules" / "curriculum.toml"
BEFORE_SFT_AT_MOST, AFTER_SFT_AT_LEAST = 0.10, 0.90
SOURCES = ("nanoflow", "bin", "schedules")   # what the Quickstart's run was made from, besides the packages


def quickstart_run(config) -> Path | None:
    """The Quickstart's run folder when it holds this checkout's finished run of `config` (see the docstring)."""
    run = Path(config.checkpoints.checkpoints_path)
    try:
        meta = io.read_metadata(str(run))
    except io.CheckpointError:   # no run there, or none committed
        return None
    if (meta["step"], meta["config"], meta["versions"]["torch"]) != (config.tokens.train_steps, config.to_dict(),
                                                                      torch.__version__):
        return None
    committed = (run / str(meta["step"]) / METADATA).stat().st_mtime
    changed = max(path.stat().st_mtime for folder in SOURCES for path in (REPO / folder).rglob("*")
                  if path.is_file() and "__pycache__" not in path.parts)
    return run if committed > changed else None


def skill_figures(run: Path, config) -> dict[int, float]:
    """The reversal's exact match at each evaluated step, after checking every configured set has a row at every
    step evaluation is due (and no others)."""
    schedule = Schedule.from_config(config)
    due = [s for s in range(1, config.tokens.train_steps + 1) if is_due(config, schedule, s)]
    rows = read_eval(run)
    names = [entry.name for entry in config.evaluation.datasets]
    assert sorted((r["step"], r["dataset"]) for r in rows) == sorted((s, n) for s in due for n in names)
    for r in rows:
        assert r["loss"] > 0 and r["tokens"] > 0
    return {r["step"]: r["accuracy"] for r in rows if r["dataset"] == "reverse"}


@pytest.mark.slow
def test_the_default_curriculum_teaches_reversal_of_held_out_words(tmp_path):
    config = load_config(CURRICULUM)
    run = quickstart_run(config)
    if run is None:
        run = tmp_path / "run"
        done = run_command("train", *train_args(run, config=CURRICULUM), cwd=None, timeout=3600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"eval step {config.tokens.train_steps} (sft):" in done.stdout + done.stderr   # each evaluation said
    schedule = Schedule.from_config(config)
    names = [s.name for s in schedule.stages]
    end_of_anneal = stage_steps(schedule, names.index("anneal"))[-1]
    end = config.tokens.train_steps

    exact = skill_figures(run, config)
    assert exact[end_of_anneal] <= BEFORE_SFT_AT_MOST, exact
    assert exact[end] >= AFTER_SFT_AT_LEAST, exact
