"""Weights & Biases logging ([logging.wandb]), from rank 0: a view of the run's records, like TensorBoard.

Every step logs every field of its metrics.jsonl line at its step (`stage` among them, as a string), and each
eval.jsonl row as `eval/<dataset>/<field>` at its step. The run's config (the resolved config, and the stages
as `stages`) is W&B's run config; the plan figure (observe/plan_figure.py) is the image `plan` at each start's first
step. The W&B run's id is kept in the run folder (`wandb_run_id.txt`, written by
nanoflow/io/files.py's writer): a resume continues that W&B run (`resume="allow"`); a fresh start makes a new one.
The package is the `wandb` extra; `check_installed` refuses its absence and `check_login` an online run without
W&B credentials, both before anything runs (bin/train --plan and the loop's start).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
from io import BytesIO
from pathlib import Path
from typing import Any, Literal

from nanoflow.config import Config
from nanoflow.config.schema import WandbArgs
from nanoflow.errors import ConfigError, MissingExtraError
from nanoflow.io.files import write_atomically
from nanoflow.observe.figures import has_matplotlib
from nanoflow.observe.plan_figure import plan_png
from nanoflow.schedule import Schedule

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id.txt"
EVAL_KEYS = ("loss", "tokens", "accuracy", "correct", "accuracy_norm", "correct_norm", "examples")
PLAN_KEY = "plan"
LOGIN = 'run `wandb login`, set WANDB_API_KEY, or set mode = "offline" in [logging.wandb] (`wandb sync` later)'


Mode = Literal["online", "offline", "disabled"]


def wandb_mode(args: WandbArgs) -> Mode:
    """The mode a run logs in: [logging.wandb] mode, else WANDB_MODE as W&B reads it (its "dryrun" is offline, "run"
    online), else "online" - so a cluster's WANDB_MODE=offline holds for every config that does not say otherwise."""
    if args.mode is not None:
        return args.mode
    found = os.environ.get("WANDB_MODE", "").strip()
    modes: dict[str, Mode] = {"": "online", "run": "online", "dryrun": "offline", "online": "online",
                              "offline": "offline", "disabled": "disabled"}
    mode = modes.get(found)
    if mode is None:
        raise ConfigError(f'[logging.wandb] mode is unset and WANDB_MODE={found!r} is not one nanoflow runs W&B in: '
                          'set mode = "online", "offline" or "disabled" in [logging.wandb], or WANDB_MODE to one of them')
    return mode


def check_installed(config: Config) -> None:
    """With [logging.wandb], the wandb package must be there (MissingExtraError, exit 2): said at --plan and at
    start-up, not at the first step."""
    if config.logging.wandb is not None and wandb_mode(config.logging.wandb) != "disabled" \
            and importlib.util.find_spec("wandb") is None:
        raise MissingExtraError("[logging.wandb]", "wandb", "wandb")


def check_login(config: Config) -> None:
    """With [logging.wandb] in online mode, W&B credentials must be set up (ConfigError, exit 2): looked up as
    wandb.init looks them up (a session's, WANDB_API_KEY or an identity token file, the netrc, W&B's settings file),
    without the network and without a prompt, so a run without any stops at --plan and at start-up rather than at
    wandb.init's prompt or error once the run folder is locked. The key itself is never read into a message."""
    args = config.logging.wandb
    if args is None or wandb_mode(args) != "online" or importlib.util.find_spec("wandb") is None:
        return
    try:   # W&B's own lookup; a wandb without it (older releases) asks for the login in wandb.init instead
        from wandb.errors import AuthenticationError
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
    except ImportError:
        return
    host = wandb_setup.singleton().settings.base_url   # WANDB_BASE_URL or W&B's settings file; loading starts nothing
    try:
        found = wbauth.authenticate_session(host=host, source="nanoflow", prompt=False, update_session=False)
    except AuthenticationError as e:   # a key of the wrong form: W&B's message says where and why, not the key
        raise ConfigError(f'[logging.wandb] mode = "online": the W&B login found is not usable ({e}): {LOGIN}') \
            from None
    if found is None:
        raise ConfigError(f'[logging.wandb] mode = "online" needs a W&B login and none is set up for {host} '
                          f"(no WANDB_API_KEY, no key in the netrc): {LOGIN}")


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
        self.mode: Mode = wandb_mode(self.args) if self.args is not None else "disabled"
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
            project=args.project, entity=args.entity, name=args.name or self.config.general.run, mode=self.mode,
            dir=str(where), id=run_id, resume="allow",
            config=run_config(self.config, self.schedule), allow_val_change=True,
            # nanoflow's own lines stay the run's output: W&B neither captures the console nor prints its banner
            settings=wandb.Settings(console="off", quiet=True, silent=True, disable_git=True))
        log.info(f"W&B: run {run_id} ({self.mode}){' resumed' if self.start_step else ''}")
        self._log_plan(wandb)
        return self

    def _log_plan(self, wandb) -> None:
        """The plan figure (what `--plan --plot` draws) as the image `plan`, at the first step this start trains: at
        a resume too, as a resume may have changed the stages not begun yet. Without matplotlib, a line saying so."""
        if not has_matplotlib():
            log.info("W&B: the plan figure is not logged: matplotlib is not installed (pip install '.[report]')")
            return
        from PIL import Image  # a dependency of matplotlib's

        image = Image.open(BytesIO(plan_png(self.config, self.schedule)))
        self.run.log({PLAN_KEY: wandb.Image(image)}, step=self.start_step + 1)   # the step's metrics join its row

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
