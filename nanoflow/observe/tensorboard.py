"""TensorBoard event files for a run, when the `tensorboard` package is installed; a no-op otherwise.

Every step writes `<stage>/loss`, `<stage>/lr`, `<stage>/grad_norm`, `<stage>/tokens_per_s`,
`<stage>/mfu` and `<stage>/peak_memory_bytes` — the step's record as metrics.jsonl has it, the recent
tokens/s, MFU and peak memory the progress line shows — (one chart per stage and metric, on the global
step axis) and the same under `all/` (one line across the stages) as `events.out.tfevents.*` files in the run folder, beside metrics.jsonl — so
`tensorboard --logdir runs` shows every run under its folder's name, side by side. A resume purges
the events after the step it resumes from, as metrics.jsonl does, so an abandoned attempt leaves
no doubled curve.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from nanoflow.observe.metrics import MEASURED, Throughput, tokens_per_second

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

# The step's own values, then what the progress display measured and added to its record (MEASURED less the clock).
SCALARS = ("loss", "lr", "grad_norm", *(key for key in MEASURED if key != "elapsed"))


def available() -> bool:
    """Whether the tensorboard package is installed (`pip install '.[tensorboard]'`)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardLog:
    """A context manager whose `write(metrics)` logs one step's metrics dict (step, stage, loss, lr, grad_norm,
    tokens, elapsed). Does nothing when tensorboard is not installed or `enabled` is false (ranks other than 0).

    The event files are a view, not the record (metrics.jsonl is): when they cannot be written (a full disk),
    one warning says so and TensorBoard logging stops, without a traceback, rather than the run.
    """

    def __init__(self, run_dir: str | Path, start_step: int, enabled: bool = True):
        self.directory = Path(run_dir)
        self.start_step = start_step
        self.enabled = enabled and available()
        self.writer: SummaryWriter | None = None
        self.throughput = Throughput()
        self._previous_hook: Callable[[threading.ExceptHookArgs], object] | None = None

    def __enter__(self) -> TensorBoardLog:
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._quiet_writer_thread()
            try:
                # purge_step: events from this step on, left by an abandoned attempt, are dropped on load.
                self.writer = SummaryWriter(log_dir=str(self.directory), purge_step=self.start_step + 1)
            except OSError as e:
                self._give_up(e)
        return self

    def _quiet_writer_thread(self) -> None:
        """TensorBoard's writer thread prints its own traceback when a write fails (and the main thread gets the
        error at the next call): keep that thread's OSError quiet, as it is reported once, by `_give_up`."""
        previous = self._previous_hook = threading.excepthook

        def hook(args):
            if not (issubclass(args.exc_type, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
                previous(args)

        threading.excepthook = hook

    def _give_up(self, error: OSError) -> None:
        self.writer = None   # not closed: closing flushes again, into the same error
        log.warning(f"TensorBoard logging stopped, cannot write its event file in {self.directory}: "
                  f"{error.strerror or error} (metrics.jsonl goes on)")

    def write(self, metrics: dict) -> None:
        if self.writer is None:
            return
        try:
            self._write(metrics)
        except OSError as e:
            self._give_up(e)

    def write_eval(self, row: dict) -> None:
        """One eval.jsonl row: eval/<dataset>/loss (and /accuracy, /accuracy_norm) at its step."""
        if self.writer is not None:
            try:
                for key in ("loss", "accuracy", "accuracy_norm"):
                    if key in row:
                        self.writer.add_scalar(f"eval/{row['dataset']}/{key}", row[key], row["step"])
            except OSError as e:
                self._give_up(e)

    def _write(self, metrics: dict) -> None:
        assert self.writer is not None   # write() calls it with one
        step, stage = metrics["step"], metrics["stage"]
        values = {key: metrics[key] for key in SCALARS if metrics.get(key) is not None}
        if "tokens_per_s" not in values and "elapsed" in metrics and "tokens" in metrics:  # a record without the
            # progress display's values (TensorBoardLog used on its own): each step's own rate
            rate = tokens_per_second(metrics["tokens"], self.throughput.add(metrics))
            if not math.isnan(rate):
                values["tokens_per_s"] = rate
        for key, value in values.items():
            self.writer.add_scalar(f"{stage}/{key}", value, step)
            self.writer.add_scalar(f"all/{key}", value, step)

    def __exit__(self, *exc) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
        except OSError as e:
            self._give_up(e)
        finally:
            self.writer = None
            if self._previous_hook is not None:
                threading.excepthook, self._previous_hook = self._previous_hook, None
