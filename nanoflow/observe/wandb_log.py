"""Weights & Biases logging ([logging.wandb]), from rank 0: a view of the run's records, like TensorBoard.

Every step logs every field of its metrics.jsonl line at its step (`stage` among them, as a string), and each
eval.jsonl row as `eval/<dataset>/<field>` at its step. The run's config (the resolved config, and the stages
as `stages`) is W&B's run config. The W&B run's id is kept in the run folder (`wandb_run_id.txt`, written by
nanoflow/io/files.py's writer): a resume continues that W&B run (`resume="allow"`); a fresh start makes a new one.
The package is the `wandb` extra; `check_installed` refuses its absence before anything runs (run.py).
"""

from __future__ import annotations

import importlib.util
import logging
import secrets
from pathlib import Path
from typing import Any

from nanoflow.config import Config
from nanoflow.errors import MissingExtraError
from nanoflow.io.files import write_atomically
from nanoflow.schedule import Schedule

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id.txt"
EVAL_KEYS = ("loss", "accuracy", "tokens", "correct")


def check_installed(config: Config) -> None:
    """With [logging.wandb], the wandb package must be there (MissingExtraError, exit 2): said at --plan and at
    start-up, not at the first step."""
    if config.logging.wandb is not None and config.logging.wandb.mode != "disabled" \
            and importlib.util.find_spec("wandb") is None:
        raise MissingExtraError("[logging.wandb]", "wandb", "wandb")


def run_config(config: Config, schedule: Schedule) -> dict:
    """What the W&B run's config holds: the resolved config, and the stages (name, start, batch, sequence)."""
    stages = [{"name": s.name, "start_step": s.start_step, "global_batch_size": s.global_batch_size,
               "sequence_length": s.sequence_length} for s in schedule.stages]
    return {**config.to_dict(), "stages": stages}


class WandbLog:
    """A context manager whose `write(metrics)` and `write_eval(row)` log to W&B; nothing without
    [logging.wandb] or where `enabled` is false (ranks other than 0)."""

    def __init__(self, config: Config, schedule: Schedule, run_dir: str | Path, start_step: int,
                 enabled: bool = True):
        self.args = config.logging.wandb
        self.enabled = enabled and self.args is not None
        self.config, self.schedule = config, schedule
        self.folder, self.start_step = Path(run_dir), start_step
        self.run: Any = None   # wandb's Run, once begun

    def __enter__(self) -> WandbLog:
        if not self.enabled:
            return self
        import wandb

        args = self.args
        assert args is not None   # enabled: [logging.wandb] is set
        run_id = self._run_id()
        where = Path(args.dir or self.folder)
        where.mkdir(parents=True, exist_ok=True)   # W&B would fall back to a temporary folder instead
        self.run = wandb.init(
            project=args.project, entity=args.entity, name=args.name or self.config.general.run, mode=args.mode,
            dir=str(where), id=run_id, resume="allow",
            config=run_config(self.config, self.schedule), allow_val_change=True,
            # nanoflow's own lines stay the run's output: W&B neither captures the console nor prints its banner
            settings=wandb.Settings(console="off", quiet=True, silent=True, disable_git=True))
        log.info(f"W&B: run {run_id} ({args.mode}){' resumed' if self.start_step else ''}")
        return self

    def _run_id(self) -> str:
        """The id of the W&B run this run continues (recorded in the run folder), or a new one for a fresh start."""
        path = self.folder / RUN_ID_FILE
        if self.start_step > 0 and path.is_file():
            return path.read_text().strip()
        run_id = secrets.token_hex(4)   # W&B's own ids are 8 lowercase letters and digits
        write_atomically(path, (run_id + "\n").encode(), root=self.folder)
        return run_id

    def write(self, metrics: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if k != "step" and v is not None}, step=metrics["step"])

    def write_eval(self, row: dict) -> None:
        if self.run is not None:
            self.run.log({f"eval/{row['dataset']}/{key}": row[key] for key in EVAL_KEYS if key in row},
                         step=row["step"])

    def __exit__(self, *exc) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if exc[0] is None else 1)
            self.run = None
