"""A study: several runs of one config, in order, then their comparison — `bin/sweep STUDY.toml`.

A thin layer over bin/train: each `[[runs]]` entry is `bin/train BASE --set ...` with its own run folder
(`runs_dir/NAME`, local or s3://); `branch = {from = "trunk", at = 160}` makes it a cooldown branch — it resumes
from the trunk's step folder and moves the base config's `cooldown` stage to the next step. Rerunning the study
resumes each run where it stopped (bin/train does that) and passes over runs already done. Each `[[averages]]`
entry averages a run's checkpoints (bin/average) and evaluates the result on the base config's eval sets, into
the eval.jsonl of its local record folder; a rerun checks that the average there is still made of what the entry
names (its marker's `averaged_from`), and refuses to pass an edited entry off as the old average. Last,
bin/compare draws the figure (runs_dir/compare.png; the local record folder of an S3 runs_dir) and prints the
table. The study file's shape is checked first (nanoflow/commands/study.py).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
from collections.abc import Callable

from nanoflow.commands.study import load_study
from nanoflow.config import ConfigError
from nanoflow.errors import EXIT_DONE
from nanoflow.io.files import write_atomically
from nanoflow.io.runfolder import record_folder

log = logging.getLogger(__name__)


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


def figure_path(study: dict) -> str:
    """Where the study's figure goes: its `figure`, else compare.png in runs_dir (its local record folder when
    runs_dir is on S3)."""
    return study.get("figure") or str(record_folder(study["runs_dir"]) / "compare.png")


def run_study(path: str, only: list[str] | None = None, *, train_main: Callable[[list[str]], int]) -> int:
    """Train, average and compare as the study file says; each run is `train_main(bin/train's arguments)` (the
    command front end hands its own in: a study is a layer under the commands, never above them). The first run
    that does not finish stops it with its exit status (75 after a stop signal: rerun the same command to go on)."""
    from nanoflow.commands.report import check_figure_path
    study = load_study(path)
    names = [r["name"] for r in study["runs"]]
    for name in only or []:
        if name not in names:
            near = difflib.get_close_matches(name, names, n=1)
            raise ConfigError(f"{path}: --only {name}: no run of that name" + (f" (did you mean {near[0]!r}?)" if near
                              else "") + f"; the study's runs are {', '.join(map(repr, names))}")
    if "figure" in study:
        check_figure_path(study["figure"], "figure")   # before anything is trained
    runs = [r for r in study["runs"] if not only or r["name"] in only]
    for i, run in enumerate(runs, 1):
        log.info(f"── study run {i}/{len(runs)}: {run['name']}")
        status = train_main([study["base"], *[a for s in run_overrides(study, run) for a in ("--set", s)]])
        if status != EXIT_DONE:
            return status
    for i, average in enumerate(study["averages"]):
        _average(path, study, i, average)
    from nanoflow.commands.compare import format_table, plot, read_runs
    results = read_runs([f"{study['runs_dir']}/{name}" for name in [*names, *(a["name"] for a in study["averages"])]])
    figure: str | os.PathLike = figure_path(study)
    os.makedirs(os.path.dirname(figure), exist_ok=True)
    figure = plot(results, figure)
    print(format_table(results))
    print(f"\nwrote {figure}")
    return EXIT_DONE


def _average(path: str, study: dict, index: int, average: dict) -> None:
    from nanoflow import io
    from nanoflow.checkpoint.average import average_checkpoints
    from nanoflow.config import load_config
    from nanoflow.evaluation import evaluate_checkpoint
    from nanoflow.observe.metrics import EVAL_FILE
    out, source = f"{study['runs_dir']}/{average['name']}", f"{study['runs_dir']}/{average['run']}"
    choice = {"steps": average.get("steps"), "last": average.get("last"), "weights": average.get("weights")}
    if io.checkpoints_to_try(out):
        _check_made_from(path, index, average, out, source, choice)
    else:
        summary = average_checkpoints(source, out, steps=average.get("steps"), last=average.get("last"),
                                      weights=average.get("weights"))
        log.info(f"averaged {len(summary['sources'])} checkpoints of {average['run']} into {summary['path']}")
    records = record_folder(out)
    if not (records / EVAL_FILE).exists():
        # Evaluated as the run it averages is configured (its --set: the model, the eval sets), not the bare base.
        run = next(r for r in study["runs"] if r["name"] == average["run"])
        config = load_config(study["base"], [*run.get("set", []), f"checkpoints.checkpoints_path={json.dumps(out)}"])
        rows = evaluate_checkpoint(out, config)
        text = "".join(json.dumps(row) + "\n" for row in rows)
        # Whole or not there (a rerun evaluates again); never through a link.
        write_atomically(records / EVAL_FILE, text.encode(), root=records)


def _check_made_from(path: str, index: int, average: dict, out: str, source: str, choice: dict) -> None:
    """The average committed in `out` is made of what the entry names now (the source run's checkpoints and weights
    its marker's averaged_from records); a ConfigError saying both when not."""
    from nanoflow import io
    from nanoflow.checkpoint.average import selection
    made = [(a["checkpoint"].rstrip("/").rpartition("/")[0].rpartition("/")[2], int(a["step"]), float(a["weight"]))
            for a in io.read_metadata(out).get("averaged_from") or []]
    folders, weights = selection(source, **choice)
    wanted = [(average["run"], int(f.rstrip("/").rpartition("/")[2]), w) for f, w in zip(folders, weights, strict=True)]
    if len(made) == len(wanted) and all(a[:2] == b[:2] and math.isclose(a[2], b[2], rel_tol=1e-9)
                                        for a, b in zip(made, wanted, strict=True)):
        return

    def said(parts) -> str:
        return (f"{parts[0][0] if parts else '?'} steps " + ", ".join(f"{s} ({w:.3g})" for _, s, w in parts)
                if parts else "no recorded checkpoints (not an average of bin/average's)")

    raise ConfigError(f"{path}: averages[{index}] ({average['name']}) now names {said(wanted)}, but {out} holds the "
                      f"average of {said(made)}; it is kept as it is: move it away (with its eval.jsonl) or give the "
                      "entry a new name, and run the study again")
