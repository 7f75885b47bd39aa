"""A study: several runs of one config, in order, then their comparison — `bin/sweep STUDY.toml`.

A thin layer over bin/train: each `[[runs]]` entry is `bin/train BASE --set ...` with its own run folder
(`runs_dir/NAME`); `branch = {from = "trunk", at = 160}` makes it a cooldown branch — it resumes from the
trunk's step folder and moves the base config's `cooldown` stage to the next step. Rerunning the study
resumes each run where it stopped (bin/train does that) and passes over runs already done. Each
`[[averages]]` entry averages a run's checkpoints (bin/average) and evaluates the result on the base
config's eval sets, into its folder's eval.jsonl. Last, bin/compare draws `runs_dir/compare.png` and
prints the table.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from nanoflow.config import ConfigError
from nanoflow.errors import EXIT_DONE
from nanoflow.io.files import write_atomically
from nanoflow.io.store import is_remote

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)


def load_study(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            study = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such study file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    here = Path(path).resolve().parent
    for key in ("base", "runs_dir"):
        if not isinstance(study.get(key), str):
            raise ConfigError(f"{path}: {key} must be a path (relative to the study file)")
        study[key] = study[key] if is_remote(study[key]) else str((here / study[key]).resolve())
    names = set()
    for i, run in enumerate(study.get("runs", [])):
        if not isinstance(run.get("name"), str) or run["name"] in names:
            raise ConfigError(f"{path}: runs[{i}].name must be a name, once")
        branch = run.get("branch")
        if branch is not None and (branch.get("from") not in names or not isinstance(branch.get("at"), int)):
            raise ConfigError(f"{path}: runs[{i}] ({run['name']}): branch needs from = an earlier run, at = a step")
        names.add(run["name"])
    for i, average in enumerate(study.get("averages", [])):
        if average.get("run") not in names or not isinstance(average.get("name"), str):
            raise ConfigError(f"{path}: averages[{i}] needs a name and run = one of the runs")
    return study


def run_overrides(study: dict, run: dict) -> list[str]:
    """The --set list that makes the base config this run."""
    folder = f"{study['runs_dir']}/{run['name']}"
    sets = [f"general.run={json.dumps(run['name'])}", f"checkpoints.checkpoints_path={json.dumps(folder)}"]
    branch = run.get("branch")
    if branch is not None:
        source = f"{study['runs_dir']}/{branch['from']}/{branch['at']}"
        sets += [f"checkpoints.resume_checkpoint_path={json.dumps(source)}",
                 f"data_stages.cooldown.start_training_step={branch['at'] + 1}"]
    return sets + list(run.get("set", []))


def run_study(path: str, only: list[str] | None = None, *, train_main: Callable[[list[str]], int]) -> int:
    """Train, average and compare as the study file says; each run is `train_main(bin/train's arguments)` (the
    command front end hands its own in: a study is a layer under the commands, never above them). The first run
    that does not finish stops it with its exit status (75 after a stop signal: rerun the same command to go on)."""
    study = load_study(path)
    runs = [r for r in study.get("runs", []) if not only or r["name"] in only]
    for i, run in enumerate(runs, 1):
        log.info(f"── study run {i}/{len(runs)}: {run['name']}")
        status = train_main([study["base"], *[a for s in run_overrides(study, run) for a in ("--set", s)]])
        if status != EXIT_DONE:
            return status
    for average in study.get("averages", []):
        _average(study, average)
    from nanoflow.commands.compare import format_table, plot, read_runs
    names = [r["name"] for r in study.get("runs", [])] + [a["name"] for a in study.get("averages", [])]
    results = read_runs([f"{study['runs_dir']}/{name}" for name in names])
    figure = plot(results, study.get("figure") and str(Path(path).resolve().parent / study["figure"])
                  or f"{study['runs_dir']}/compare.png")
    print(format_table(results))
    print(f"\nwrote {figure}")
    return EXIT_DONE


def _average(study: dict, average: dict) -> None:
    from nanoflow import io
    from nanoflow.checkpoint.average import average_checkpoints
    from nanoflow.config import load_config
    from nanoflow.evaluation import evaluate_checkpoint
    from nanoflow.observe.metrics import EVAL_FILE
    out = f"{study['runs_dir']}/{average['name']}"
    if not io.checkpoints_to_try(out) if os.path.exists(out) else True:
        summary = average_checkpoints(f"{study['runs_dir']}/{average['run']}", out, steps=average.get("steps"),
                                      last=average.get("last"), weights=average.get("weights"))
        log.info(f"averaged {len(summary['sources'])} checkpoints of {average['run']} into {summary['path']}")
    eval_file = Path(out) / EVAL_FILE
    if not eval_file.exists():
        # Evaluated as the run it averages is configured (its --set: the model, the eval sets), not the bare base.
        source = next(r for r in study["runs"] if r["name"] == average["run"])
        config = load_config(study["base"], [*source.get("set", []), f"checkpoints.checkpoints_path={json.dumps(out)}"])
        rows = evaluate_checkpoint(out, config)
        text = "".join(json.dumps(row) + "\n" for row in rows)
        write_atomically(eval_file, text.encode(), root=out)   # whole or not there (a rerun evaluates again); no link
