"""Several runs side by side: `bin/compare RUN_DIR... --output compare.png`.

Each run folder gives its eval.jsonl (held-out losses), its metrics.jsonl (tokens per step) and its
checkpoint metadata (the model and stages, for FLOPs; where it began). A branch — a run whose
`resume_checkpoint_path` names another run's step folder, or an averaged checkpoint (bin/average's
`averaged_from`) — owns only its own steps' FLOPs; the trunk's up to the branch point are shared, so
they count once in the study's total and in full in the branch's own "FLOPs to get here". FLOPs are
nanoflow/flops.py's count per token times the tokens each step trained.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import attrs

from nanoflow.commands.report import _figure, read_run_metadata, save_figure
from nanoflow.config import recorded_model
from nanoflow.errors import CompareError
from nanoflow.flops import flops_per_token
from nanoflow.io.runfolder import record_folder
from nanoflow.io.store import is_remote
from nanoflow.observe.metrics import FILE, read_eval, read_metrics


@attrs.frozen
class _Model:   # the [model] keys flops_per_token reads, from a checkpoint's recorded config
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int


@attrs.frozen
class RunResult:
    name: str
    path: str
    steps: int                       # the last step evaluated
    own_flops: float                 # the FLOPs of the steps this run trained itself
    flops: float                     # own + the origin's up to where this run began (what it took to get here)
    origin: tuple[str, int] | None   # (the run folder it began from, as named to read_runs; the step)
    cosine: bool                     # a baseline: one cosine decay over the whole run, no origin
    evals: dict[str, list[tuple[int, float]]]   # eval set: [(step, loss)] in step order
    flops_at: dict[int, float]       # step: FLOPs to get there (for the FLOPs axis)
    note: str | None = None          # why its FLOPs are not known (nan), when they are not

    def final(self, dataset: str) -> float:
        points = self.evals.get(dataset)
        return points[-1][1] if points else math.nan


def step_flops(metadata: dict, metrics: list[dict]) -> dict[int, float]:
    """{step: the training FLOPs of that step}: its tokens × flops_per_token at its stage's sequence length."""
    config = metadata["config"]
    recorded = recorded_model(config["model"])   # complete, also a record older than the model families
    model = _Model(**{k: recorded[k] for k in attrs.fields_dict(_Model)})
    default = config["tokens"]["sequence_length"]
    lengths = {s["name"]: s.get("sequence_length") or default for s in config.get("data_stages", [])}
    return {m["step"]: m["tokens"] * flops_per_token(model, lengths.get(m["stage"], default)) for m in metrics}


def _origin(metadata: dict) -> tuple[list[str], int] | None:
    """(the folders the run it began from was recorded at, most telling first; the step it began from), or None.

    A branch records the step folder it began from (lineage `began_from`, else its `resume_checkpoint_path`); an
    average, each source checkpoint as bin/average was given it (maybe relative to where it ran) and, in the
    config it copies from its newest source, the folder that source was written to."""
    averaged = metadata.get("averaged_from")
    config = metadata["config"]["checkpoints"]
    if averaged:
        folder, _, _ = averaged[-1]["checkpoint"].rstrip("/").rpartition("/")
        return [folder, config["checkpoints_path"]], int(averaged[-1]["step"])
    source = (metadata.get("lineage") or {}).get("began_from") or config.get("resume_checkpoint_path")
    if not source:
        return None
    folder, _, step = source.rstrip("/").rpartition("/")
    return ([folder], int(step)) if step.isdigit() else None


def _place(path: str) -> str:
    return path.rstrip("/") if is_remote(path) else os.path.normpath(os.path.abspath(path))


class _Places:
    """Which of the runs named a recorded folder means: the run now at that path, or the run that was written
    there (its checkpoints record their checkpoints_path) — a study moved or copied elsewhere, or named by
    relative paths, still finds the trunk its branches began from."""

    def __init__(self, paths: list[str], metadata: dict[str, dict | None]):
        self.here = {_place(p): p for p in paths}
        self.here.update({os.path.realpath(p): p for p in paths if not is_remote(p)})
        self.written: dict[str, list[str]] = {}
        for p in paths:
            meta = metadata[p] or {}
            recorded = (meta.get("config") or {}).get("checkpoints", {}).get("checkpoints_path")
            if recorded and not meta.get("averaged_from"):   # an average's config is its source's: not its own
                self.written.setdefault(_place(recorded), []).append(p)

    def find(self, run: str, folders: list[str]) -> str | None:
        """The named run `run` began from, recorded as `folders`; None when it is not among the runs named."""
        for folder in folders:
            if not is_remote(folder) and not os.path.isabs(folder):
                continue      # relative to a working directory long gone: only the written-at folder tells
            here = self.here.get(_place(folder))
            candidates = list(dict.fromkeys([p for p in [here, *self.written.get(_place(folder), [])] if p]))
            if len(candidates) > 1:   # copies of one study named together: the one beside this run, else the one there
                beside = [p for p in candidates if os.path.dirname(_place(p)) == os.path.dirname(_place(run))]
                candidates = beside if len(beside) == 1 else [here] if here else beside or candidates
            if len(candidates) > 1:
                raise CompareError(f"{run} began from {folder}, the folder each of {', '.join(candidates)} was written "
                                   "to: name only one of them")
            if candidates:
                return candidates[0]
        return None


def records(path: str) -> Path:
    """Where a run's eval.jsonl and metrics.jsonl are: the run folder, or for an s3:// run its local record folder
    (runs/s3/<bucket>/<prefix> here, where bin/train wrote them)."""
    return record_folder(path) if is_remote(path) else Path(path)


def read_run(path: str | os.PathLike, origins: dict[str, RunResult] | None = None,
             places: _Places | None = None) -> RunResult:
    """One run folder's result; `origins` ({run folder as named: result}) are the runs it may have begun from."""
    path = os.fspath(path)
    rows = read_eval(records(path))
    if not rows:
        raise CompareError(f"{path}: no eval.jsonl rows in {records(path)} (train it with an [evaluation] section, "
                           "or evaluate it)")
    metadata = read_run_metadata(path)
    if metadata is None:
        raise CompareError(f"{path}: no committed checkpoint, so no config to count its FLOPs from")
    note = None
    if os.path.lexists(records(path) / FILE):   # (one that cannot be read is the reader's one-line error)
        own = step_flops(metadata, read_metrics(records(path)))
    elif metadata.get("averaged_from"):
        own = {}    # an average trained nothing of its own
    else:           # its own steps' tokens are not known: no count at all, rather than the trunk's alone
        own, note = None, f"{path} has no {FILE}, so the FLOPs of the steps it trained are not known"
    recorded = _origin(metadata)
    origin, base = None, 0.0
    if recorded is not None:
        places = places or _Places([*(origins or {}), path], {p: read_run_metadata(p) for p in [*(origins or {}), path]})
        trunk_path = places.find(path, recorded[0])
        if trunk_path == path:
            recorded = None          # a resume of its own older checkpoint: no other run's steps in it
        elif trunk_path is None or trunk_path not in (origins or {}):
            raise CompareError(f"{path} began from {recorded[0][0]}/{recorded[1]}: name that run too, to count its "
                               "FLOPs")
        else:
            origin = (trunk_path, recorded[1])
            base = origins[trunk_path].flops_at.get(recorded[1], math.nan)
    flops_at, total, own_flops = {}, base, math.nan if own is None else sum(own.values())
    if own is None:
        own, total = {}, math.nan
    elif math.isnan(base):
        note = note or f"{path}: the FLOPs of {origin[0]} up to step {origin[1]}, where it began, are not known"
    for step in sorted(own):
        total += own[step]
        flops_at[step] = total
    if not own and origin is not None and not note:
        flops_at[origin[1]] = base
    evals: dict[str, list[tuple[int, float]]] = {}
    for row in sorted(rows, key=lambda r: r["step"]):
        evals.setdefault(row["dataset"], []).append((row["step"], row["loss"]))
    schedule = metadata["config"]["optimizer"]["learning_rate_scheduler"]
    reached = metadata["config"]["tokens"]["train_steps"]
    stage_lrs = [s for s in metadata["config"].get("data_stages", [])
                 if s.get("learning_rate_scheduler") and s["start_training_step"] <= reached]
    cosine = recorded is None and schedule.get("lr_decay_style", "cosine") == "cosine" and not stage_lrs
    return RunResult(name=Path(path.rstrip("/")).name, path=path, steps=max(r["step"] for r in rows),
                     own_flops=own_flops, flops=total, origin=origin,
                     cosine=cosine, evals=evals, flops_at=flops_at, note=note)


def read_runs(paths: list[str]) -> list[RunResult]:
    """Every run, in the order given; each origin is read before the runs that began from it. A branch's origin
    is found among the runs named by where it is now or by where it was written (see _Places)."""
    paths = list(dict.fromkeys(os.fspath(p) for p in paths))
    for p in paths:
        if not is_remote(p) and not os.path.isdir(p):
            raise CompareError(f"{p} is a file, not a run folder" if os.path.lexists(p) else f"{p}: no such run folder")
    metadata = {p: read_run_metadata(p) for p in paths}
    places = _Places(paths, metadata)
    after = {}
    for p in paths:
        recorded = _origin(metadata[p]) if metadata[p] else None
        found = places.find(p, recorded[0]) if recorded else None
        after[p] = found if found != p else None
    pending, done = list(paths), {}
    while pending:
        ready = [p for p in pending if after[p] is None or after[p] in done]
        if not ready:
            raise CompareError(f"{pending[0]}: the runs named begin from each other in a circle")
        for path in ready:
            done[path] = read_run(path, done, places)
            pending.remove(path)
    return [done[p] for p in paths]


def cosine_gap(run: RunResult, runs: list[RunResult], dataset: str) -> float:
    """The run's final loss minus that of the cosine run of the same length; nan when there is none."""
    baseline = next((r for r in runs if r.cosine and r.steps == run.steps and r is not run), None)
    return run.final(dataset) - baseline.final(dataset) if baseline is not None else math.nan


def shared_savings(runs: list[RunResult]) -> tuple[float, float]:
    """(FLOPs of the branches trained as separate runs from scratch, FLOPs the shared trunk and branches took)."""
    branched = [r for r in runs if r.origin is not None]
    trunks = {r.origin[0] for r in branched}
    separate = sum(r.flops for r in branched)
    shared = sum(r.own_flops for r in branched) + sum(r.flops for r in runs if r.path in trunks)
    return separate, shared


def format_table(runs: list[RunResult]) -> str:
    datasets = list(dict.fromkeys(d for r in runs for d in r.evals))
    header = ["run", "steps", "FLOPs", *[f"{d} loss" for d in datasets], *[f"{d} gap" for d in datasets]]
    lines = [header]
    for r in runs:
        lines.append([r.name, str(r.steps), "n/a" if math.isnan(r.flops) else f"{r.flops:.3g}",
                      *[f"{r.final(d):.4f}" for d in datasets], *[_signed(cosine_gap(r, runs, d)) for d in datasets]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
            for line in lines]
    text.insert(1, "  ".join("─" * w for w in widths))
    separate, shared = shared_savings(runs)
    unknown = [r.note for r in runs if r.note]
    if math.isnan(separate) or math.isnan(shared):
        text.append("\nthe compute the shared trunk spared is not known: some FLOPs are n/a")
    elif separate:
        text.append(f"\nbranches as separate runs: {separate:.3g} FLOPs; trunk once + branches: {shared:.3g} FLOPs "
                    f"(saved {separate - shared:.3g}, {1 - shared / separate:.0%})")
    text.append("gap: final loss minus the cosine run's of the same length (negative: better than cosine)")
    text += [f"n/a: {note}" for note in unknown]
    return "\n".join(text)


def _signed(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:+.4f}"


def eval_sets(runs: list[RunResult]) -> list[str]:
    """The eval sets of the runs, in the order they first come."""
    return list(dict.fromkeys(d for r in runs for d in r.evals))


def check_dataset(runs: list[RunResult], dataset: str | None) -> str:
    """The eval set to draw: `dataset`, once some run has it (default: the first)."""
    names = eval_sets(runs)
    if dataset is None:
        return names[0]
    if dataset not in names:
        raise CompareError(f"--dataset {dataset}: no run has an eval set of that name; they have "
                           + ", ".join(names))
    return dataset


# Ten colours that stay apart (matplotlib's tab10), one a family; within a family, line styles, then markers.
FAMILY_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
                 "#17becf")
MEMBER_STYLES = ("-", "--", ":", "-.")
MEMBER_MARKERS = ("", "o", "s", "^", "v")


def family(name: str) -> str:
    """A run's family: its name up to the first part that is a number (wsd-1sqrt-160-decay5 → wsd-1sqrt,
    cosine-40 → cosine, trunk → trunk): the runs of one schedule at several lengths."""
    parts = name.split("-")
    cut = next((i for i, part in enumerate(parts) if i > 0 and part.isdigit()), len(parts))
    return "-".join(parts[:cut])


def line_styles(names: list[str]) -> dict[str, dict]:
    """How each run is drawn: its family's colour, and a line style (then a marker) of its own within the family."""
    families = list(dict.fromkeys(map(family, names)))
    members: dict[str, int] = {}
    styles = {}
    for name in names:
        k = members[family(name)] = members.get(family(name), -1) + 1
        styles[name] = dict(color=FAMILY_COLORS[families.index(family(name)) % len(FAMILY_COLORS)],
                            linestyle=MEMBER_STYLES[k % len(MEMBER_STYLES)],
                            marker=MEMBER_MARKERS[k // len(MEMBER_STYLES) % len(MEMBER_MARKERS)] or None)
    return styles


def plot(runs: list[RunResult], output: str | os.PathLike, dataset: str | None = None) -> Path:
    """Held-out loss of `dataset` (default: the first) against step and against FLOPs, one line per run, written
    to exactly `output` (its suffix names the format; PNG without one). Returns the path written."""
    return save_figure(draw(runs, dataset), output, "--output")


def draw(runs: list[RunResult], dataset: str | None = None):
    """The figure plot() writes: each family of runs in one colour (the legend lists the families), each run in a
    line style of its own and named at the end of its line on the step panel."""
    figure = _figure()
    dataset = check_dataset(runs, dataset)
    by_step, by_flops = figure.subplots(1, 2)
    styles, named = line_styles([r.name for r in runs]), set()
    ends = []
    for r in runs:
        points = r.evals.get(dataset, [])
        steps = [s for s, _ in points]
        losses = [v for _, v in points]
        flops = [r.flops_at.get(s, math.nan) for s in steps]
        style = dict(styles[r.name], gid=r.name, label="_nolegend_" if family(r.name) in named else family(r.name))
        if len(points) == 1 and style["marker"] is None:
            style["marker"] = "o"
        named.add(family(r.name))
        by_step.plot(steps, losses, **style)
        by_flops.plot(flops, losses, **style)
        if points:
            ends.append((steps[-1], losses[-1], r.name, style["color"]))
    for ax, label in ((by_step, "step"), (by_flops, "training FLOPs (a trunk's counted once, up to each branch)")):
        ax.set_xlabel(label)
        ax.set_ylabel(f"held-out loss ({dataset})")
        ax.grid(alpha=0.3)
    _name_line_ends(by_step, ends)
    by_step.legend(fontsize=7)
    figure.suptitle(f"held-out {dataset} loss of {len(runs)} runs")
    figure.tight_layout()
    return figure


def _name_line_ends(ax, ends: list[tuple[float, float, str, str]]) -> None:
    """Each run's name beside the last point of its line; names that end at one step are pushed apart to at least
    3 % of the panel's height, in the order of their losses."""
    low, high = ax.get_ylim()
    gap, width = 0.03 * (high - low), ax.get_xlim()[1] - ax.get_xlim()[0]
    by_step: dict[float, list] = {}
    for end in ends:
        by_step.setdefault(end[0], []).append(end)
    for step, group in by_step.items():
        placed = None
        for _, loss, name, color in sorted(group, key=lambda e: e[1]):
            placed = loss if placed is None else max(loss, placed + gap)
            ax.annotate(name, xy=(step, loss), xytext=(step + 0.01 * width, placed), textcoords="data", fontsize=6,
                        color=color, va="center", annotation_clip=False)
