"""The plan as a picture: `bin/train CONFIG --plan --plot plan.png`. The drawing is nanoflow/observe/plan_figure.py's
(W&B logs the same figure at a run's start); this writes it where --plot says."""

from __future__ import annotations

import os
from pathlib import Path

from nanoflow.commands.report import DPI, save_figure
from nanoflow.observe import plan_figure as drawing
from nanoflow.observe.plan_figure import MAX_POINTS, PANELS, plan_steps  # noqa: F401 (this module's names too)


def plan_figure(run):
    """The plan's matplotlib Figure (`run`: nanoflow.run.open_run(config, join=False))."""
    return drawing.plan_figure(run.config, run.schedule)


def write_plan_plot(run, path: str | os.PathLike) -> Path:
    """Draw the plan of `run` into the PNG at `path`."""
    return save_figure(plan_figure(run), path, "--plot", dpi=DPI)
