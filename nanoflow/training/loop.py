"""The driver: runs steps state.step+1 .. train_steps, switching stage loaders as the schedule says.

It orchestrates; the stage math lives in schedule.py, the step in step.py, the data in data/, what the
user watches in observe/progress.py, the record of every step (metrics.jsonl) in observe/metrics.py, and stop
signals in signals.py. Every message goes through logging (nanoflow/console.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TextIO

from nanoflow import console, io
from nanoflow.checkpoint.checkpointer import Checkpointer, StorageLostError
from nanoflow.config import Config, unreached_stages, untrained_splits
from nanoflow.data import open_stage
from nanoflow.data.loader import check_stages
from nanoflow.data.fingerprint import Fingerprints
from nanoflow.evaluation import Evaluator
from nanoflow.io.runfolder import check_folder, check_room
from nanoflow.io.store import StoreError, check_root
from nanoflow.observe.metrics import FILE, MetricsLog, set_aside
from nanoflow.parallel.mesh import Topology, init_topology
from nanoflow.preflight import preflight
from nanoflow.observe.progress import Progress
from nanoflow.schedule import active_stage, stage_steps
from nanoflow.parallel.shards import state_bytes
from nanoflow.training import signals
from nanoflow.training.signals import StopRequest
from nanoflow.state import TrainState
from nanoflow.step import train_step
from nanoflow.observe.tensorboard import TensorBoardLog

log = logging.getLogger(__name__)


def run_dir(config: Config) -> Path:
    """Where metrics.jsonl goes: the checkpoint folder when it is local, else runs/s3/<bucket>/<prefix> here —
    keyed by the checkpoints' own place, so that two runs on S3 never share a record, whatever their names
    (the prefix's parts are plain: config/checks.py refuses empty, "." and ".." ones)."""
    path = config.checkpoints.checkpoints_path
    if "://" not in path:
        return Path(path)
    return Path("runs", "s3", *path[len("s3://"):].rstrip("/").split("/"))


def train(config: Config, *, fresh: bool = False, until_step: int | None = None, out: TextIO | None = None,
          progress: bool | None = None, topology: Topology | None = None) -> TrainState:
    """Train `config` to train_steps, resuming from its latest committed checkpoint unless `fresh`.

    Saves every checkpoint_interval steps, at the end, when a stop signal arrives, and after
    `until_step` (stop there, as a planned interruption, without changing the schedule). Under
    torchrun every rank runs this; only rank 0 says anything and writes metrics.jsonl. Every
    message of the call goes to `out` when given, else through logging (nanoflow/console.py). The
    run folder's lock (io/lock.py) is held from before anything is read until the end, or the error.
    """
    topology = init_topology(config) if topology is None else topology
    with console.routed(out, enabled=topology.is_main):
        tokenizer = preflight(config).tokenizer  # before the run folder is locked or anything is read
        check_root(config.checkpoints.checkpoints_path)  # "s3:/b/x" is refused, never made a local folder "s3:"
        checkpointer = Checkpointer(config, topology)
        checkpointer.on_main(lambda: check_folder(str(run_dir(config))))  # a file, or unwritable: said before the lock
        with checkpointer.locked():
            return _train(config, checkpointer, fresh=fresh, until_step=until_step, progress=progress,
                          topology=topology, tokenizer=tokenizer)


def _train(config: Config, checkpointer: Checkpointer, *, fresh: bool, until_step: int | None, progress: bool | None,
           topology: Topology, tokenizer) -> TrainState:
    for name in unreached_stages(config):
        log.warning(f'stage "{name}" starts after train_steps = {config.tokens.train_steps}: not reached')
    for line in untrained_splits(config):
        log.warning(line)

    directory = run_dir(config)
    fingerprints = checkpointer.fingerprints = Fingerprints(config, tokenizer)  # shared: each stage's, once
    state = checkpointer.restore(fresh=fresh)
    schedule = state.schedule
    if state.step >= schedule.train_steps:  # restore said "nothing to do"
        return state
    if until_step is not None and state.step >= until_step:
        log.info(f"nothing to do: step {state.step} is done, at or after until_step = {until_step}")
        return state
    if fresh:  # the old run's records are kept beside the new one's (none of it is deleted)
        for old, new in checkpointer.on_main(lambda: set_aside(directory)) or []:
            log.info(f"--fresh: the old run's {old} moved to {new}, kept; this run writes a new {old.name}")
    needed = 0 if "://" in config.checkpoints.checkpoints_path else state_bytes(state.model)
    checkpointer.on_main(lambda: check_room(str(directory), needed))
    _check_stages_ahead(config, schedule, state.step, tokenizer)
    report = Progress.start(state, progress if topology.is_main else False,  # logs the start-up header
                            config.logging.iteration_step_info_interval)
    stop = StopRequest(topology)
    loader, loader_index = None, None
    try:
        with stop.installed(), MetricsLog(directory / FILE, state.step, topology.is_main) as metrics_log, \
                TensorBoardLog(directory, state.step, topology.is_main) as tensorboard_log, \
                Evaluator(config, topology, tokenizer, directory, state.step, tensorboard_log) as evaluator:
            for step in range(state.step + 1, schedule.train_steps + 1):
                index = active_stage(schedule, step)
                if index != loader_index:
                    if loader is not None:
                        loader.close()  # free the finished stage's data before the next one loads
                    if topology.is_main:  # the fingerprint of the files as this stage reads them, not as at its save
                        fingerprints.of([schedule.stages[index].name])
                    loader, loader_index = open_stage(config, index, tokenizer, schedule), index
                    report.stage_started(schedule, index)
                state, metrics = train_step(state, loader.batch_at(step, topology.dp_rank, topology.dp))
                metrics["elapsed"] = round(report.elapsed(), 3)
                report.step_done(metrics)  # shown, with its recent tokens/s, MFU and peak memory added to the record
                metrics_log.write(metrics)
                tensorboard_log.write(metrics)
                evaluator.maybe_run(state)  # when due: every evaluation.interval steps and at each stage's end
                if until_step is not None and step >= until_step:
                    stop.requested = stop.requested or f"until_step = {until_step} (a planned stop, not a signal)"
                stopping = stop.agreed()
                checkpointer.poll()  # commits a background save (async_save) once every rank has written it
                if checkpointer.should_save(step, stopping):  # the last save waits for its commit
                    checkpointer.save(state, last=bool(stopping) or step == schedule.train_steps)
                    if step == schedule.train_steps or (until_step is not None and step >= until_step):
                        signals.mark_finished()  # committed: a signal from now on changes nothing (exit 0)
                if stopping and until_step is not None and step >= until_step:
                    log.info(f"stopped after step {step} of {schedule.train_steps} as asked (until_step = "
                             f"{until_step}), schedule unchanged; run again without it, or with a later one, "
                             "to go on from the checkpoint just saved")
                    break
                if stopping:
                    log.info(f"stopped by {stopping} after step {step} of {schedule.train_steps}; "
                             "run the same command again to resume from the checkpoint just saved")
                    break
    except (StoreError, io.CheckpointError) as e:
        if isinstance(e, io.CheckpointError) and not isinstance(e.__cause__, StoreError):
            raise
        raise StorageLostError(f"{e}\nthe last committed checkpoint stands: run the same command again to resume "
                               "from it") from None
    finally:
        if loader is not None:
            loader.close()
        report.close()
    if state.step == schedule.train_steps:
        log.info(f"done: {state.step} steps in {report.elapsed():.1f}s; metrics in {directory / FILE}")
    return state


def _check_stages_ahead(config: Config, schedule, completed: int, tokenizer) -> None:
    """Open, and close again, the data of the current stage and of every later one this run reaches: a missing
    column, a short or truncated file or a wrong tokenizer there stops the run before its next step, not at the
    stage switch hours in, and the problems of all of them come in one error."""
    stages = [index for index in range(active_stage(schedule, completed + 1), len(schedule.stages))
              if stage_steps(schedule, index)]
    check_stages(config, stages, tokenizer, schedule)
