"""The study file of `bin/sweep STUDY.toml`: read, and its shape checked key by key before anything runs.

    base = "base.toml"             # the config every run starts from (relative to the study file)
    runs_dir = "../runs/study"     # a local folder or s3://bucket/prefix: each run in runs_dir/NAME
    figure = "compare.png"         # optional (relative to the study file): bin/compare's figure
    [[runs]]                       # at least one, trained in order
    name = "trunk"                 # a run's name (general.run's rule): its folder's name too
    set = ["tokens.train_steps=160"]              # optional: bin/train's --set, each a string
    branch = {from = "trunk", at = 32}            # optional: an earlier run's step to begin from
    [[averages]]                   # optional: bin/average of a run, evaluated on its eval sets
    name = "trunk-avg"             # a name of its own: no run's, no other average's
    run = "trunk"
    last = 3                       # or steps = [64, 72, 80]; optional weights = [1, 1, 2]

Anything else — a key no study has (the nearest is named), a value of another kind, a name that is a path, a
name given twice — is a ConfigError naming the key, exit status 2 (nanoflow/commands/sweep.py runs the study).
"""

from __future__ import annotations

import difflib
import json
import math
import os
from pathlib import Path

from nanoflow.config import ConfigError
from nanoflow.config.checks import run_name_problem
from nanoflow.errors import StoreError
from nanoflow.io.store import check_root, is_remote

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

STUDY_KEYS = ("base", "runs_dir", "figure", "runs", "averages")
RUN_KEYS = ("name", "set", "branch")
BRANCH_KEYS = ("from", "at")
AVERAGE_KEYS = ("name", "run", "last", "steps", "weights")


def load_study(path: str) -> dict:
    """The study at `path`, its shape checked, base and runs_dir resolved against its folder, runs and averages
    present (maybe empty)."""
    raw = _read(path)
    problem = shape_problem(raw)
    if problem is not None:
        raise ConfigError(f"{path}: {problem}")
    here = Path(path).resolve().parent
    study = {**raw, "runs": raw["runs"], "averages": raw.get("averages", [])}
    for key in ("base", "runs_dir"):
        study[key] = raw[key] if is_remote(raw[key]) else str((here / raw[key]).resolve())
    try:
        check_root(study["runs_dir"])
    except StoreError as e:
        raise ConfigError(f"{path}: runs_dir: {e}") from None
    if not os.path.isfile(study["base"]):
        raise ConfigError(f"{path}: base = {raw['base']!r}: no such config file ({study['base']})")
    if "figure" in raw:
        study["figure"] = str(here / raw["figure"])
    return study


def _read(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such study file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a folder, not a study file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); a study file is TOML") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None


def shape_problem(study: dict) -> str | None:
    """What is wrong with the shape of a study, the first thing found; None when nothing is."""
    problem = _unknown(study, STUDY_KEYS, "", "a study has base, runs_dir, figure, [[runs]] and [[averages]]")
    for key in ("base", "runs_dir", "figure"):
        if problem is None and (key in study or key != "figure") and not _text(study.get(key)):
            problem = f"{key}: a path (a string, relative to the study file), not {_shown(study.get(key))}"
    runs = study.get("runs")
    if problem is None and runs is not None and not _tables(runs):
        problem = f"runs: [[runs]] tables, one per run, not {_shown(runs)}"
    if problem is None and not runs:
        problem = 'no [[runs]]: a study trains at least one run ([[runs]] with name = "…" and set = […])'
    names: list[str] = []
    for i, run in enumerate(runs if problem is None else []):
        problem = problem or _run_problem(i, run, names)
        names.append(run.get("name"))
    averages = study.get("averages", [])
    if problem is None and not _tables(averages):
        problem = f"averages: [[averages]] tables, one per average, not {_shown(averages)}"
    taken = list(names)
    for i, average in enumerate(averages if problem is None else []):
        problem = problem or _average_problem(i, average, names, taken)
        taken.append(average.get("name"))
    return problem


def _run_problem(i: int, run: dict, earlier: list[str]) -> str | None:
    at = f"runs[{i}]"
    name = run.get("name")
    sets, branch = run.get("set", []), run.get("branch")
    problem = (_unknown(run, RUN_KEYS, f"{at}.", "a run has name, set and branch")
               or run_name_problem(f"{at}.name", name)
               or (f"{at}.name = {name!r}: a second run of that name" if name in earlier else None))
    if problem is None and not (isinstance(sets, list) and all(isinstance(s, str) for s in sets)):
        problem = f'{at}.set: a list of --set strings such as "tokens.train_steps=160", not {_shown(sets)}'
    if problem is None and branch is not None:
        if not isinstance(branch, dict):
            return f'{at}.branch: a table {{from = "RUN", at = STEP}}, not {_shown(branch)}'
        problem = _unknown(branch, BRANCH_KEYS, f"{at}.branch.", 'a branch has from = "RUN" and at = STEP')
        if problem is None and branch.get("from") not in earlier:
            problem = (f"{at}.branch.from = {_shown(branch.get('from'))}: not the name of an earlier run "
                       f"({', '.join(map(repr, earlier)) or 'there is none'})")
        if problem is None and not _whole(branch.get("at"), 1):
            problem = f"{at}.branch.at = {_shown(branch.get('at'))}: the step to begin from (a whole number, 1 or more)"
    return problem


def _average_problem(i: int, average: dict, runs: list[str], taken: list[str]) -> str | None:
    at = f"averages[{i}]"
    name = average.get("name")
    problem = (_unknown(average, AVERAGE_KEYS, f"{at}.", "an average has name, run, last or steps, and weights")
               or run_name_problem(f"{at}.name", name))
    if problem is None and name in taken:
        what = "a run's name" if name in runs else "the name of an earlier average"
        problem = f"{at}.name = {name!r}: already {what} (each is written to runs_dir/NAME: one folder each)"
    if problem is None and average.get("run") not in runs:
        problem = (f"{at}.run = {_shown(average.get('run'))}: not a run of the study "
                   f"({', '.join(map(repr, runs))})")
    if problem is None and ("last" in average) == ("steps" in average):
        problem = f"{at}: one of last = K (the last K checkpoints) or steps = [A, B, …]"
    if problem is None and "last" in average and not _whole(average["last"], 1):
        problem = f"{at}.last = {_shown(average['last'])}: a number of checkpoints (1 or more)"
    steps = average.get("steps")
    if problem is None and steps is not None and not (isinstance(steps, list) and steps
                                                      and all(_whole(s, 0) for s in steps)):
        problem = f"{at}.steps = {_shown(steps)}: a list of step numbers"
    weights = average.get("weights")
    count = average.get("last") if steps is None else len(steps)
    if problem is None and weights is not None:
        if not (isinstance(weights, list) and all(_number(w) for w in weights)):
            problem = f"{at}.weights = {_shown(weights)}: a list of numbers, one per checkpoint"
        elif len(weights) != count:
            problem = f"{at}.weights: {len(weights)} weights for {count} checkpoints"
        elif not all(math.isfinite(w) and w >= 0 for w in weights) or not 0 < sum(weights) < math.inf:
            problem = f"{at}.weights = {_shown(weights)}: finite numbers ≥ 0 whose sum is finite and not 0"
    return problem


def _unknown(table: dict, keys: tuple[str, ...], at: str, has: str) -> str | None:
    for key in table:
        if key not in keys:
            near = difflib.get_close_matches(key, keys, n=1)
            return f"{at}{key}: unknown key" + (f" (did you mean {near[0]!r}?)" if near else "") + f"; {has}"
    return None


def _tables(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)


def _text(value) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value) -> str:
    """A value as the study file would spell it, for a message."""
    if isinstance(value, dict):
        return "one table" if value else "an empty table"
    try:
        return json.dumps(value)
    except (TypeError, ValueError):   # a date or time: TOML has them, JSON not
        return repr(value)
