"""The plan as a picture, from the config alone: `bin/train CONFIG --plan --plot plan.png` writes it, and W&B logs it
at a run's start (observe/wandb_log.py).

Over global steps: the stages as bands, the LR (each stage's own schedule included), the global
batch, the sequence length (each stage's RoPE written at its start) and each source's share of the
samples — what to look at before spending a GPU-week. matplotlib (the `report` extra) draws.
"""

from __future__ import annotations

import os
from io import BytesIO

from nanoflow.config import Config, NanosetDatasetsArgs, stage_rope
from nanoflow.io.store import is_remote
from nanoflow.lr import scheduled_lr
from nanoflow.observe.figures import COLORS, DPI, StageSpan, draw_stage_bands, label_stages, new_figure
from nanoflow.schedule import Schedule, active_stage, stage_steps

MAX_POINTS = 2000   # steps drawn per curve: every step of a short run, an even sample (with every switch) of a long one
PANELS = ("learning rate", "global batch", "sequence length", "source share")


def plan_steps(schedule: Schedule) -> list[int]:
    """The steps to draw: all of them up to MAX_POINTS, else an even sample plus each stage's first and last."""
    last = schedule.train_steps
    stride = max(1, -(-last // MAX_POINTS))
    steps = set(range(1, last + 1, stride)) | {last}
    for index in range(len(schedule.stages)):
        span = stage_steps(schedule, index)
        if span:
            steps |= {span[0], span[-1]}
    return sorted(steps)


def plan_figure(config: Config, schedule: Schedule):
    """The plan's matplotlib Figure, one panel per PANELS entry, sharing the step axis."""
    steps = plan_steps(schedule)
    spans = [StageSpan(stage.name, stage.start_step, stage_steps(schedule, i)[-1], True)
             for i, stage in enumerate(schedule.stages) if stage_steps(schedule, i)]
    unreached = [stage.name for i, stage in enumerate(schedule.stages) if not stage_steps(schedule, i)]
    figure = new_figure()
    figure.set_size_inches(1200 / DPI, 1100 / DPI)
    axes = figure.subplots(len(PANELS), 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.5, 1.5, 2]})
    stage_of = [active_stage(schedule, s) for s in steps]
    lrs = [scheduled_lr(s, config, schedule) for s in steps]
    batch = [schedule.stages[i].global_batch_size for i in stage_of]
    length = [schedule.stages[i].sequence_length for i in stage_of]
    for ax, label in zip(axes, PANELS, strict=True):
        draw_stage_bands(ax, spans)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    _by_stage(axes[0], steps, stage_of, lrs, "tab:orange")
    axes[0].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    edges = _edges(steps)
    axes[1].stairs(batch, edges, color="tab:blue", linewidth=1.4, baseline=None)
    axes[2].stairs(length, edges, color="tab:green", linewidth=1.4, baseline=None)
    for index, stage in enumerate(schedule.stages):   # each reached stage's RoPE, where its positions begin
        if stage_steps(schedule, index):
            axes[2].annotate(stage_rope(config, index).describe(), (stage.start_step - 0.5, stage.sequence_length),
                             xytext=(2, 2), textcoords="offset points", fontsize=7, color="tab:green")
    _draw_shares(axes[3], config, schedule, steps, edges)
    label_stages(axes[0], spans)
    axes[-1].set_xlabel("step")
    axes[-1].set_xlim(0.5, schedule.train_steps + 0.5)
    title = f"{config.general.project}/{config.general.run}: {schedule.train_steps:,} steps"
    if unreached:
        title += f" (not reached: {', '.join(unreached)})"
    figure.suptitle(title)
    figure.subplots_adjust(left=0.09, right=0.76, top=0.91, bottom=0.06, hspace=0.15)
    return figure


def plan_png(config: Config, schedule: Schedule) -> bytes:
    """The plan figure as PNG bytes (what --plot writes), drawn in memory: nothing is written."""
    buffer = BytesIO()
    plan_figure(config, schedule).savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def source_shares(config: Config, schedule: Schedule, step: int) -> dict[str, float] | None:
    """The share of each source of the blend in the samples of global step `step`, by source name (a token
    folder by its folder name); None when the stage's token folders have no dataset_weights (then the
    shares follow the folders' sizes, which only reading them tells)."""
    dataset = config.data_stages[active_stage(schedule, step)].data.dataset
    if isinstance(dataset, NanosetDatasetsArgs):
        if dataset.dataset_weights is None:
            return None if len(dataset.folders) > 1 else {os.path.basename(dataset.folders[0].rstrip("/")): 1.0}
        named = [(os.path.basename(f.rstrip("/")), w) for f, w in zip(dataset.folders, dataset.dataset_weights, strict=True)]
    else:
        named = [(_source_label(dataset, name), w) for name, w in dataset.weighted_names()]
    total = sum(w for _, w in named)
    return {name: w / total for name, w in named}


def _source_label(dataset, name: str) -> str:
    """A source of HF datasets as a person names it: a builder by its files ("json: data/sft.jsonl")."""
    if not isinstance(dataset.hf_dataset_or_datasets, str):   # a table: the name is a path or glob, or a hub name
        return shown_path(name) if os.path.isabs(name) else name
    files = dataset.hf_data_files
    if files is None:
        return name
    files = [files] if isinstance(files, str) else files
    return f"{name}: " + ", ".join(shown_path(f) for f in files)


def shown_path(path: str) -> str:
    """Paths are stored absolute; show them relative to the working directory when that is shorter."""
    if is_remote(path):
        return path
    relative = os.path.relpath(path)
    return relative if len(relative) < len(path) else path


def _edges(steps: list[int]) -> list[float]:
    """Where each drawn step's stretch begins, and the end of the last: a value holds from its step to the next
    drawn one, so a switch falls on the band edge between two steps."""
    return [s - 0.5 for s in steps] + [steps[-1] + 0.5]


def _by_stage(ax, steps, stage_of, values, color) -> None:
    """One segment per stage: no line drawn across a switch, where the value may jump."""
    start = 0
    while start < len(steps):
        end = start
        while end < len(steps) and stage_of[end] == stage_of[start]:
            end += 1
        ax.plot(steps[start:end], values[start:end], color=color, linewidth=1.3,
                marker="." if len(steps) <= 60 else None)
        start = end


def _draw_shares(ax, config: Config, schedule: Schedule, steps: list[int], edges: list[float]) -> None:
    """Each source's share, stacked; a source keeps its colour across the stages that read it."""
    shares = [source_shares(config, schedule, s) for s in steps]
    names = list(dict.fromkeys(name for share in shares if share for name in share))
    below = [0.0] * len(steps)
    for i, name in enumerate(names):
        top = [b + (share or {}).get(name, 0.0) for b, share in zip(below, shares, strict=True)]
        ax.stairs(top, edges, baseline=below, fill=True, color=COLORS[i % len(COLORS)], alpha=0.75, label=name)
        below = top
    if names:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if any(share is None for share in shares):
        ax.text(0.5, 0.5, "token folders without dataset_weights: shares follow their sizes",
                transform=ax.transAxes, ha="center", va="center", fontsize=9, color="0.3")
    ax.set_ylim(0, 1)
