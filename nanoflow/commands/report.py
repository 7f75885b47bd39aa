"""The run report: `bin/report RUN_DIR` → RUN_DIR/report.png and a per-stage summary table.

Reads RUN_DIR/metrics.jsonl (nanoflow.observe.metrics: one JSON object per step: step, stage, loss, lr, tokens, elapsed …)
and, when RUN_DIR holds a committed checkpoint, its metadata: the configured stages and
train_steps, so that a report drawn mid-run shows the whole curriculum, stages not reached yet
included. matplotlib (the `report` extra) is imported only to draw, without pyplot.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

import attrs

from nanoflow.errors import MissingExtraError, PlotError
from nanoflow.io.files import refuse_link, write_atomically
from nanoflow.io.runfolder import checkpoints_of_record
from nanoflow.observe.figures import (  # noqa: F401 (COLORS, HEIGHT, WIDTH: this module's names too)
    COLORS,
    DPI,
    HEIGHT,
    WIDTH,
    StageSpan,
    draw_stage_bands,
    label_stages,
)
from nanoflow.observe.figures import new_figure as _figure
from nanoflow.observe.metrics import read_eval, read_metrics, step_seconds, tokens_per_second

LEGEND_X = 1.09   # the eval legend's left edge, in eval-panel widths: right of the accuracy axis and its label


@attrs.frozen
class StageSummary:
    """One stretch of consecutive steps of one stage, as metrics.jsonl recorded it."""

    name: str
    first_step: int
    last_step: int
    steps: int
    tokens: int
    first_loss: float
    last_loss: float
    seconds: float



def stage_summary(metrics: list[dict]) -> list[StageSummary]:
    """One row per stretch of consecutive steps of the same stage, in step order."""
    rows: list[StageSummary] = []
    for m, seconds in zip(metrics, step_seconds(metrics), strict=True):
        last = rows[-1] if rows else None
        if last is not None and last.name == m["stage"]:
            rows[-1] = attrs.evolve(last, last_step=m["step"], steps=last.steps + 1, tokens=last.tokens + m["tokens"],
                                    last_loss=m["loss"], seconds=last.seconds + seconds)
        else:
            rows.append(StageSummary(m["stage"], m["step"], m["step"], 1, m["tokens"], m["loss"], m["loss"], seconds))
    return rows


def format_summary(rows: list[StageSummary]) -> str:
    """The summary as an aligned text table, with a total line."""
    header = ("stage", "steps", "n steps", "tokens", "first loss", "last loss", "time", "tok/s")
    body = [(r.name, f"{r.first_step}–{r.last_step}", f"{r.steps:,}", f"{r.tokens:,}", f"{r.first_loss:.4f}",
             f"{r.last_loss:.4f}", f"{r.seconds:.1f}s", _rate(r.tokens, r.seconds))
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    tokens, seconds = sum(r.tokens for r in rows), sum(r.seconds for r in rows)
    return "\n".join([line(header), "  ".join("─" * w for w in widths), *map(line, body), "",
                      f"total: {sum(r.steps for r in rows):,} steps, {tokens:,} tokens, {seconds:.1f}s"])


def _rate(tokens: int, seconds: float) -> str:
    rate = tokens_per_second(tokens, seconds)
    return "–" if math.isnan(rate) else f"{rate:,.0f}"


def stage_spans(metrics: list[dict], metadata: dict | None = None) -> list[StageSpan]:
    """Where each stage lies on the step axis: from the checkpoint's config when there is one (every stage,
    reached or not, up to train_steps), else from the stages the metrics show."""
    last_logged = metrics[-1]["step"]
    config = (metadata or {}).get("config") or {}
    stages = sorted(((s["name"], s["start_training_step"]) for s in config.get("data_stages", [])), key=lambda s: s[1])
    train_steps = config.get("tokens", {}).get("train_steps")
    if not stages or train_steps is None:
        return [StageSpan(r.name, r.first_step, r.last_step, True) for r in stage_summary(metrics)]
    spans = []
    for i, (name, start) in enumerate(stages):
        end = min(stages[i + 1][1] - 1 if i + 1 < len(stages) else train_steps, train_steps)
        if start <= end:
            spans.append(StageSpan(name, start, end, start <= last_logged))
    return spans


def read_run_metadata(run_dir: str | os.PathLike) -> dict | None:
    """The metadata of a run folder's latest intact checkpoint (local or s3://; for the local record folder of an
    S3 run, runs/s3/<bucket>/<prefix>, its checkpoints' on S3), or None when it holds none."""
    from nanoflow import console, io

    for place in [os.fspath(run_dir), *checkpoints_of_record(os.fspath(run_dir))]:
        try:
            with console.silenced("nanoflow.io.checkpoint"):
                if io.latest(place):
                    return io.read_metadata(place)
        except io.CheckpointError:
            continue
    return None


def figure_kind(path: Path) -> str:
    """The format a figure is written in: its file's suffix, PNG without one."""
    return path.suffix[1:].lower() or "png"


def check_figure_path(path: str | os.PathLike, option: str) -> Path:
    """`path`, once it is a place a figure can be written (`option` names it in the message): a format matplotlib
    writes, an existing folder, not a folder itself, not a link. Checked before any work."""
    path = Path(path)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise MissingExtraError("drawing", "matplotlib", "report") from None
    formats = FigureCanvasAgg.get_supported_filetypes()
    if figure_kind(path) not in formats:
        raise PlotError(f"{option} {path}: matplotlib cannot write .{figure_kind(path)} files; name a file ending in "
                        + ", ".join(f".{k}" for k in sorted(formats)) + " (or none: PNG)")
    if path.is_dir():
        raise PlotError(f"{option} {path} is a folder; name the figure's file")
    if not path.parent.is_dir():
        raise PlotError(f"{option} {path}: no folder {path.parent} to write it in (make it first, or name another)")
    refuse_link(path)
    return path


def save_figure(figure, path: str | os.PathLike, option: str, **savefig) -> Path:
    """Write `figure` whole to exactly `path` (never through a link: nanoflow.io.files), in the format its suffix
    names (PNG without one); returns the path written."""
    path = check_figure_path(path, option)
    buffer = BytesIO()
    figure.savefig(buffer, format=figure_kind(path), **savefig)
    try:
        write_atomically(path, buffer.getbuffer())
    except OSError as e:
        raise PlotError(f"{option} {path}: cannot write it: {e.strerror or e}") from None
    return path



def _plot_eval(ax, rows: list[dict]) -> None:
    """Eval loss per dataset (solid, left axis) and accuracy (dashed, right axis, 0–100 %): an exact-match set's
    exact match, a multiple-choice set's (rows with accuracy_norm) accuracy, lm-eval's acc; the axis says which."""
    names = list(dict.fromkeys(row["dataset"] for row in rows))
    accuracy_ax, kinds = None, set[str]()
    for i, name in enumerate(names):
        mine = [row for row in rows if row["dataset"] == name]
        color = f"C{i % 10}"
        ax.plot([r["step"] for r in mine], [r["loss"] for r in mine], color=color, marker=".", linewidth=1.2,
                label=f"{name} loss")
        if any("accuracy" in r for r in mine):
            kind = "accuracy" if any("accuracy_norm" in r for r in mine) else "exact match"
            kinds.add(kind)
            accuracy_ax = accuracy_ax or ax.twinx()
            accuracy_ax.plot([r["step"] for r in mine], [100 * r.get("accuracy", float("nan")) for r in mine],
                             color=color, marker="x", linestyle="--", linewidth=1.2, label=f"{name} {kind}")
    ax.set_ylabel("eval loss")
    handles, labels = ax.get_legend_handles_labels()
    if accuracy_ax is not None:
        accuracy_ax.set_ylim(-2, 102)
        # Exact match is an accuracy too: a panel of both kinds says "accuracy", its legend which each set is.
        accuracy_ax.set_ylabel(f"{kinds.pop() if len(kinds) == 1 else 'accuracy'} %")
        more = accuracy_ax.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    # Beside the panel, right of the accuracy axis: inside, a legend of several sets hides the curves it names.
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(LEGEND_X, 1.0), borderaxespad=0)


def plot(metrics: list[dict], spans: list[StageSpan], path: str | os.PathLike, *, title: str = "",
         eval_rows: Sequence[dict] = ()) -> Path:
    """Draw loss, learning rate and tokens/s against step (and the eval curves, when there are eval rows), each
    stage a labelled band, into a WIDTH × HEIGHT PNG."""
    return save_figure(draw(metrics, spans, title=title, eval_rows=eval_rows), path, "--out", dpi=DPI)


def draw(metrics: list[dict], spans: list[StageSpan], *, title: str = "", eval_rows: Sequence[dict] = ()):
    """The report's matplotlib Figure (see plot)."""
    figure = _figure()
    ratios = [3, 2, 2] + ([3] if eval_rows else [])
    axes = figure.subplots(len(ratios), 1, sharex=True, gridspec_kw={"height_ratios": ratios})
    steps = [m["step"] for m in metrics]
    rate = [tokens_per_second(m["tokens"], s) for m, s in zip(metrics, step_seconds(metrics), strict=True)]
    panels = ((axes[0], [m["loss"] for m in metrics], "loss", "tab:blue"),
              (axes[1], [m["lr"] for m in metrics], "learning rate", "tab:orange"),
              (axes[2], rate, "tokens / s", "tab:green"))
    rows = stage_summary(metrics)
    for ax in axes[3:]:
        _plot_eval(ax, list(eval_rows))
    for ax in axes:
        draw_stage_bands(ax, spans)
        ax.grid(True, alpha=0.3)
    for ax, values, label, color in panels:
        start = 0
        for row in rows:   # one segment per stage: no line drawn across a stage switch
            ax.plot(steps[start:start + row.steps], values[start:start + row.steps], color=color, linewidth=1.2,
                    marker="." if len(steps) <= 60 else None)
            start += row.steps
        ax.set_ylabel(label)
    label_stages(axes[0], spans)
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes[-1].set_xlabel("step")
    axes[-1].set_xlim(min(spans[0].start, steps[0]) - 0.5, max(spans[-1].end, steps[-1]) + 0.5)
    if title:
        figure.suptitle(title)
    # With eval rows, room on the right for the accuracy axis (its label, its 100 % tick) and the legend.
    figure.subplots_adjust(left=0.09, right=0.78 if eval_rows else 0.98, top=0.91 if title else 0.94, bottom=0.07,
                           hspace=0.12)
    return figure


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> tuple[Path, list[StageSummary]]:
    """Draw RUN_DIR/report.png (or `out`) and return its path with the per-stage summary."""
    metrics = read_metrics(run_dir)
    metadata = read_run_metadata(run_dir)
    general = ((metadata or {}).get("config") or {}).get("general", {})
    title = "/".join(x for x in (general.get("project"), general.get("run")) if x) or os.fspath(run_dir)
    path = plot(metrics, stage_spans(metrics, metadata), out or Path(run_dir) / "report.png", title=title,
                eval_rows=read_eval(run_dir))
    return path, stage_summary(metrics)
