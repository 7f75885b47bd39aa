"""Opening a training run, in order, and its loop: the one sequence from a config to the last step.

    with open_training(config) as training:      # config, run, lock, checkpoint, model, optimizer, data: in order
        state = training.run_loop()              # steps training.state.step + 1 .. train_steps

`open_training` is where every front end that trains enters (bin/train, and through it bin/sweep and
bin/verify-resume; `train` is the one-call form a library user or a test calls); docs/design.md lists its order.
The loop orchestrates; the stage math lives in schedule.py, the step in step.py, the data in data/, what the
user watches in observe/progress.py, the record of every step (metrics.jsonl) in observe/metrics.py, and stop
signals in signals.py. Every message goes through logging (nanoflow/console.py).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

import attrs

from nanoflow import console
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.config import Config, load_config, stage_rope, unreached_stages, untrained_splits
from nanoflow.data import open_stage
from nanoflow.data.loader import StageLoader, check_stages
from nanoflow.evaluation import Evaluator
from nanoflow.io.runfolder import check_folder, check_room
from nanoflow.io.store import check_root
from nanoflow.observe.metrics import FILE, MetricsLog, set_aside
from nanoflow.observe.progress import Progress
from nanoflow.observe.tensorboard import TensorBoardLog
from nanoflow.observe.wandb_log import WandbLog, check_installed, check_login
from nanoflow.parallel import runtime
from nanoflow.parallel.agree import on_main
from nanoflow.parallel.mesh import Topology, device
from nanoflow.parallel.shards import state_bytes
from nanoflow.run import Run, as_run
from nanoflow.schedule import active_stage, stage_steps
from nanoflow.state import TrainState
from nanoflow.step import train_step
from nanoflow.training.signals import StopRequest

log = logging.getLogger(__name__)

GC_INTERVAL = 50   # steps between the loop's garbage collections (GarbageCollection)


@contextlib.contextmanager
def open_training(config: str | Path | Config | Run, *, overrides: Sequence[str] = (), fresh: bool = False,
                  until_step: int | None = None, out: TextIO | None = None,
                  topology: Topology | None = None) -> Iterator[Training]:
    """Open a training run, in order, and hand it over ready to train: its state resumed from its latest
    committed checkpoint (or fresh: `fresh`, or none yet), its run folder locked until the block ends.

    `config` is a TOML path (with `overrides`, as --set gives them), a Config, or an opened nanoflow.run.Run.
    `until_step` stops the run there, saved, as a planned interruption (the schedule unchanged). Under torchrun
    every rank makes this call; only rank 0 says anything. Every message goes to `out` when given, else through
    logging (nanoflow/console.py)."""
    # 1. The config: every rule a file can break on its own, checked in one pass (nanoflow.config).
    if isinstance(config, str | Path):
        config = load_config(config, list(overrides))
    # 2. The run: torch's process-wide settings, the topology joined, the checks that need more than the file, the
    #    tokenizer, the schedule (nanoflow.run.open_run); all before the run folder is locked or anything is read.
    run = as_run(config, topology)
    check_installed(run.config)
    on_main(lambda: check_login(run.config), run.topology)   # rank 0 logs to W&B: its login counts, said on every rank
    with console.routed(out, enabled=run.topology.is_main):
        check_root(run.config.checkpoints.checkpoints_path)  # "s3:/b/x" is refused, never made a local folder "s3:"
        checkpointer = Checkpointer(run)
        on_main(lambda: check_folder(str(run.folder)), run.topology)  # a file, or unwritable: said before the lock
        # 3. The lock (nanoflow.io.lock), held from before anything is read until the block ends, or the error.
        with checkpointer.locked():
            _warn_of_unused_data(run.config)
            # 4. The lineage and the checkpoint to resume from, read and checked; the model and the optimizer built
            #    (nanoflow.build) and filled from it, or fresh: from general.seed or [model] init_from.
            state = checkpointer.restore(fresh=fresh)
            stop = StopRequest(run.topology, until_step=until_step, train_steps=run.schedule.train_steps)
            done = stop.nothing_to_do(state.step)
            # 5. The data and the run folder: the old records set aside (fresh), room checked, every stage ahead
            #    opened and closed; the loop opens each stage's loader at its first step.
            if not done:
                _prepare_folder(run, state, fresh)
            yield Training(run, checkpointer, state, stop, done)


def train(config: str | Path | Config | Run, *, fresh: bool = False, until_step: int | None = None,
          out: TextIO | None = None, progress: bool | None = None, topology: Topology | None = None) -> TrainState:
    """Train `config` to train_steps (or `until_step`), resuming from its latest committed checkpoint unless
    `fresh`: open_training, then its loop, in one call. Saves every checkpoint_interval steps, at the end, when a
    stop signal arrives, and after `until_step`. `progress` as Training.run_loop takes it."""
    with open_training(config, fresh=fresh, until_step=until_step, out=out, topology=topology) as training:
        return training.run_loop(progress)


@attrs.define(eq=False)
class Training:
    """A training run open_training opened: the run, its checkpointer (its lock held), the state to go on from and
    the stop request the loop answers; `done` when nothing is left to train."""

    run: Run
    checkpointer: Checkpointer
    state: TrainState
    stop: StopRequest
    done: bool

    def run_loop(self, progress: bool | None = None) -> TrainState:
        """Train steps state.step + 1 .. train_steps, switching stage loaders as the schedule says, and return the
        last state: saved every checkpoint_interval steps, at the end, on a stop signal and after until_step.
        `progress`: the live progress line (None: when the output is a terminal; rank 0 only)."""
        run, checkpointer, stop, state = self.run, self.checkpointer, self.stop, self.state
        if self.done:
            return state
        report = Progress.start(state, progress if run.topology.is_main else False,  # logs the start-up header
                                run.config.logging.iteration_step_info_interval, attention=_attention(run))
        stages = _Stages(run, report)
        try:
            with stop.installed(), MetricsLog(run.folder / FILE, state.step, run.topology.is_main) as metrics_log, \
                    TensorBoardLog(run.folder, state.step, run.topology.is_main) as tensorboard_log, \
                    WandbLog(run.config, run.schedule, run.folder, state.step, run.topology.is_main) as wandb_log, \
                    Evaluator(run, state.step, (tensorboard_log, wandb_log)) as evaluator, GarbageCollection() as garbage:
                for step in range(state.step + 1, run.schedule.train_steps + 1):
                    batch = stages.loader_for(step).batch_at(step, run.topology.dp_rank, run.topology.dp)
                    state, metrics = train_step(state, batch)
                    self.state = state
                    metrics["elapsed"] = round(report.elapsed(), 3)
                    report.step_done(metrics)  # shown, with its recent tokens/s, MFU and peak memory added to the record
                    metrics_log.write(metrics)
                    tensorboard_log.write(metrics)
                    wandb_log.write(metrics)
                    evaluator.maybe_run(state)  # when due: every evaluation.interval steps and at each stage's end
                    stopping = stop.after(step)  # agreed by every rank: until_step reached, or a signal
                    stop.saved(step, checkpointer.after_step(state, stopping=stopping))
                    garbage.after(step)
                    if stopping:
                        log.info(stop.message(step))
                        break
        finally:
            stages.close()
            report.close()
        if state.step == run.schedule.train_steps:
            log.info(f"done: {state.step} steps in {report.elapsed():.1f}s; metrics in {run.folder / FILE}")
        return state


class GarbageCollection:
    """Python's garbage collector off while the loop runs, and a collection of its young generations every
    `interval` steps, between steps: left to itself it collects at whatever allocation crosses its threshold,
    in the middle of a step and on one rank at a time, and the other ranks wait for that one at the next
    collective (torchtitan's loop does the same, every 50 steps)."""

    def __init__(self, interval: int | None = None):
        self.interval, self.was_enabled = interval or GC_INTERVAL, gc.isenabled()

    def __enter__(self) -> GarbageCollection:
        gc.disable()
        gc.collect(1)
        return self

    def after(self, step: int) -> None:
        if step % self.interval == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.was_enabled:
            gc.enable()


def _attention(run: Run) -> str:
    """The start-up header's attention line: the kernel the model's attention gets on this device."""
    longest = max(stage.sequence_length for stage in run.schedule.stages)
    return f"scaled_dot_product_attention → {runtime.attention_kernel(run.config.model, device(), longest)}"


def _warn_of_unused_data(config: Config) -> None:
    for name in unreached_stages(config):
        log.warning(f'stage "{name}" starts after train_steps = {config.tokens.train_steps}: not reached')
    for line in untrained_splits(config):
        log.warning(line)


def _prepare_folder(run: Run, state: TrainState, fresh: bool) -> None:
    """Set the old run's records aside for a fresh start (none of them is deleted); check the run folder has room
    for one more checkpoint; open, and close, the data ahead."""
    if fresh:
        for old, new in on_main(lambda: set_aside(run.folder), run.topology) or []:
            log.info(f"--fresh: the old run's {old} moved to {new}, kept; this run writes a new {old.name}")
    needed = 0 if run.is_remote else state_bytes(state.model, ema=state.ema is not None)
    on_main(lambda: check_room(str(run.folder), needed), run.topology)
    runtime.make_flight_recorder_folder(run.folder)   # every rank dumps its own file there on a hang
    _check_stages_ahead(run, state.step)


class _Stages:
    """The loader of the stage being trained, switched at each stage's first step (train_step switches the model's
    RoPE to the stage's)."""

    def __init__(self, run: Run, report: Progress):
        self.run, self.report = run, report
        self.loader: StageLoader | None = None
        self.index: int | None = None

    def loader_for(self, step: int):
        index = active_stage(self.run.schedule, step)
        if index != self.index:
            self.close()  # free the finished stage's data before the next one loads
            if self.run.topology.is_main:  # the fingerprint of the files as this stage reads them, not as at its save
                self.run.fingerprints.of([self.run.schedule.stages[index].name])
            self.loader = open_stage(self.run.config, index, self.run.tokenizer, self.run.schedule)
            self.index = index
            ropes = [stage_rope(self.run.config, i) for i in range(len(self.run.schedule.stages))]
            self.report.stage_started(self.run.schedule, index,
                                      ropes[index].describe() if len(set(ropes)) > 1 else None)
        return self.loader

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None


def _check_stages_ahead(run: Run, completed: int) -> None:
    """Open, and close again, the data of the current stage and of every later one this run reaches: a missing
    column, a short or truncated file or a wrong tokenizer there stops the run before its next step, not at the
    stage switch hours in, and the problems of all of them come in one error."""
    schedule = run.schedule
    stages = [index for index in range(active_stage(schedule, completed + 1), len(schedule.stages))
              if stage_steps(schedule, index)]
    check_stages(run.config, stages, run.tokenizer, schedule)
