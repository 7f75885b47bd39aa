"""The run report: `bin/report RUN_DIR` → RUN_DIR/report.png and a per-stage summary table.

Reads RUN_DIR/metrics.jsonl (one JSON object per step: step, stage, loss, lr, tokens, elapsed …)
and, when RUN_DIR holds a committed checkpoint, its metadata: the configured stages and
train_steps, so that a report drawn mid-run shows the whole curriculum, stages not reached yet
included. matplotlib (the `report` extra) is imported only to draw, without pyplot.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs

from nanoflow.errors import NanoflowError

WIDTH, HEIGHT, DPI = 1200, 900, 100   # report.png's size in pixels
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")


class ReportError(NanoflowError, ValueError):
    """A run folder without usable metrics."""


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


@attrs.frozen
class StageSpan:
    """A stage's place on the step axis, [start, end] inclusive; `trained` is false for a stage not reached yet."""

    name: str
    start: int
    end: int
    trained: bool


def load_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The run's metrics.jsonl, one dict per step, in step order (a last line cut by a kill is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file (bin/train writes it into the run folder, "
                          "checkpoints.checkpoints_path; runs/<run>/ when checkpoints go to S3)") from None
    metrics = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            metrics.append(json.loads(line))
        except ValueError:
            if number == len(lines):
                continue
            raise ReportError(f"{path}:{number}: not a JSON line") from None
    if not metrics:
        raise ReportError(f"{path} holds no steps yet")
    return sorted(metrics, key=lambda m: m["step"])


def step_seconds(metrics: list[dict]) -> list[float]:
    """Wall time of each step, from `elapsed` (seconds since the start of the process that trained it).

    A resumed run's process starts its clock again: its first step counts from 0.
    """
    seconds, previous = [], 0.0
    for m in metrics:
        elapsed = float(m.get("elapsed", 0.0))
        seconds.append(elapsed - previous if elapsed >= previous else elapsed)
        previous = elapsed
    return seconds


def stage_summary(metrics: list[dict]) -> list[StageSummary]:
    """One row per stretch of consecutive steps of the same stage, in step order."""
    rows: list[StageSummary] = []
    for m, seconds in zip(metrics, step_seconds(metrics)):
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
             f"{r.last_loss:.4f}", f"{r.seconds:.1f}s", f"{r.tokens / r.seconds:,.0f}" if r.seconds > 0 else "–")
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    tokens, seconds = sum(r.tokens for r in rows), sum(r.seconds for r in rows)
    return "\n".join([line(header), "  ".join("─" * w for w in widths), *map(line, body), "",
                      f"total: {sum(r.steps for r in rows):,} steps, {tokens:,} tokens, {seconds:.1f}s"])


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
    """The metadata of a local run folder's latest intact checkpoint, or None when it holds none."""
    import warnings

    from nanoflow import io

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", io.CheckpointWarning)
            return io.read_metadata(os.fspath(run_dir)) if io.latest(os.fspath(run_dir)) else None
    except io.CheckpointError:
        return None


def _figure():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("drawing needs matplotlib, which is not installed: "
                          "pip install 'nanoflow[report]' (or pip install matplotlib)") from None
    figure = Figure(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    FigureCanvasAgg(figure)
    return figure


def draw_stage_bands(ax, spans: list[StageSpan]) -> None:
    """Each stage a coloured band on `ax` (fainter when not reached), a dashed line at each switch."""
    for i, span in enumerate(spans):
        ax.axvspan(span.start - 0.5, span.end + 0.5, color=COLORS[i % len(COLORS)],
                   alpha=0.12 if span.trained else 0.05, linewidth=0)
        if i:
            ax.axvline(span.start - 0.5, color="0.4", linewidth=0.8, linestyle="--")


def label_stages(ax, spans: list[StageSpan]) -> None:
    """The stage names above `ax`, each over its band."""
    for i, span in enumerate(spans):
        ax.text((span.start + span.end) / 2, 1.01, span.name + ("" if span.trained else " (not reached)"),
                transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=9,
                color=COLORS[i % len(COLORS)])


def plot(metrics: list[dict], spans: list[StageSpan], path: str | os.PathLike, *, title: str = "") -> Path:
    """Draw loss, learning rate and tokens/s against step, each stage a labelled band, into a WIDTH × HEIGHT PNG."""
    figure = _figure()
    axes = figure.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]})
    steps = [m["step"] for m in metrics]
    rate = [m["tokens"] / s if s > 0 else float("nan") for m, s in zip(metrics, step_seconds(metrics))]
    panels = ((axes[0], [m["loss"] for m in metrics], "loss", "tab:blue"),
              (axes[1], [m["lr"] for m in metrics], "learning rate", "tab:orange"),
              (axes[2], rate, "tokens / s", "tab:green"))
    rows = stage_summary(metrics)
    for ax, values, label, color in panels:
        draw_stage_bands(ax, spans)
        start = 0
        for row in rows:   # one segment per stage: no line drawn across a stage switch
            ax.plot(steps[start:start + row.steps], values[start:start + row.steps], color=color, linewidth=1.2,
                    marker="." if len(steps) <= 60 else None)
            start += row.steps
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    label_stages(axes[0], spans)
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes[2].set_xlabel("step")
    axes[2].set_xlim(min(spans[0].start, steps[0]) - 0.5, max(spans[-1].end, steps[-1]) + 0.5)
    if title:
        figure.suptitle(title)
    figure.subplots_adjust(left=0.09, right=0.98, top=0.91 if title else 0.94, bottom=0.07, hspace=0.12)
    path = Path(path)
    figure.savefig(path, dpi=DPI, format="png")
    return path


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> tuple[Path, list[StageSummary]]:
    """Draw RUN_DIR/report.png (or `out`) and return its path with the per-stage summary."""
    metrics = load_metrics(run_dir)
    metadata = read_run_metadata(run_dir)
    general = ((metadata or {}).get("config") or {}).get("general", {})
    title = "/".join(x for x in (general.get("project"), general.get("run")) if x) or os.fspath(run_dir)
    path = plot(metrics, stage_spans(metrics, metadata), out or Path(run_dir) / "report.png", title=title)
    return path, stage_summary(metrics)
