"""What every figure of nanoflow's shares: its size, the stage colours, the stage bands and their labels, and a
matplotlib Figure made without pyplot (no global state, no display). matplotlib is the `report` extra."""

from __future__ import annotations

import attrs

from nanoflow.errors import MissingExtraError

WIDTH, HEIGHT, DPI = 1200, 900, 100   # report.png's size in pixels
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")


@attrs.frozen
class StageSpan:
    """A stage's place on the step axis, [start, end] inclusive; `trained` is false for a stage not reached yet."""

    name: str
    start: int
    end: int
    trained: bool


def has_matplotlib() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


def new_figure():
    """A WIDTH × HEIGHT Figure on the Agg canvas (MissingExtraError without matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtraError("drawing", "matplotlib", "report") from None
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
