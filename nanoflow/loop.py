"""The driver: runs steps state.step+1 .. train_steps, switching stage loaders as the schedule says.

It orchestrates and reports; the stage math lives in schedule.py, the step in step.py, the data
in data/. Progress goes to a live bar on a terminal and to plain lines otherwise; every step is
one JSON line in metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import TextIO

import torch

from nanoflow import io
from nanoflow.config import Config, unreached_stages
from nanoflow.data import check_stages, load_run_tokenizer, open_stage
from nanoflow.data.fingerprint import Fingerprints
from nanoflow.errors import EXIT_STORAGE, NanoflowError
from nanoflow.io.runfolder import RunFolderError, RunFolderWriteError, check_folder, check_room, open_for_append
from nanoflow.io.store import StoreError, check_root
from nanoflow.parallel import SINGLE, Topology, broadcast_object, device, init_topology
from nanoflow.schedule import TrainingMetadata, active_stage, begun_stages, resume_point, stage_steps
from nanoflow.snapshot import checkpoint_blocks, checkpoint_bytes, read_on_every_rank, restore_state
from nanoflow.state import TrainState, init_state
from nanoflow.step import train_step
from nanoflow.tensorboard import TensorBoardLog

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StorageLostError(NanoflowError):
    """Storage failed once training had begun: not the config's fault, and what was committed stands."""

    exit_status = EXIT_STORAGE


def run_dir(config: Config) -> Path:
    """Where metrics.jsonl goes: the checkpoint folder when it is local, else runs/<run> here."""
    path = config.checkpoints.checkpoints_path
    return Path("runs", config.general.run) if "://" in path else Path(path)


def train(config: Config, *, fresh: bool = False, until_step: int | None = None, out: TextIO = sys.stdout,
          progress: bool | None = None, topology: Topology | None = None) -> TrainState:
    """Train `config` to train_steps, resuming from its latest committed checkpoint unless `fresh`.

    Saves every checkpoint_interval steps, at the end, when a stop signal arrives, and after
    `until_step` (stop there, as a planned interruption, without changing the schedule). Under
    torchrun every rank runs this; only rank 0 prints and writes metrics.jsonl. The run folder's
    lock (io/lock.py) is held from before anything is read until the end, or the error.
    """
    topology = init_topology(config) if topology is None else topology
    check_root(config.checkpoints.checkpoints_path)  # "s3:/b/x" is refused, never made a local folder "s3:"
    _on_main(topology, lambda: check_folder(str(run_dir(config))))  # a file, or unwritable: said before the lock
    with run_lock(config, topology, out):
        return _train(config, fresh=fresh, until_step=until_step, out=out, progress=progress, topology=topology)


@contextlib.contextmanager
def run_lock(config: Config, topology: Topology, out: TextIO):
    """Rank 0 holds checkpoints_path's lock for the run; every rank fails together if it cannot."""
    path, held = config.checkpoints.checkpoints_path, []
    _on_main(topology, lambda: held.append(io.RunLock.acquire(path, run=config.general.run,
                                                              say=lambda text: print(text, file=out, flush=True))))
    try:
        yield
    finally:
        for lock in held:
            problem = lock.release()
            if problem:
                print(f"warning: {problem}", file=out)


def _on_main(topology: Topology, action) -> None:
    """Run `action` on rank 0; a NanoflowError it raises is raised on every rank (never a rank left waiting)."""
    failure = None
    if topology.is_main:
        try:
            action()
        except NanoflowError as e:
            failure = e
    failure = broadcast_object(failure, topology)
    if failure is not None:
        raise failure


def _train(config: Config, *, fresh: bool, until_step: int | None, out: TextIO, progress: bool | None,
           topology: Topology) -> TrainState:
    if not topology.is_main:
        out = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    tokenizer = load_run_tokenizer(config)
    for name in unreached_stages(config):
        print(f'warning: stage "{name}" starts after train_steps = {config.tokens.train_steps}: not reached',
              file=out)

    directory = run_dir(config)
    fingerprints = Fingerprints(config, tokenizer)
    state = start_state(config, topology, fresh=fresh, out=out, fingerprints=fingerprints)
    schedule = state.schedule
    if state.step >= schedule.train_steps:  # start_state said "nothing to do"
        return state
    if until_step is not None and state.step >= until_step:
        print(f"nothing to do: step {state.step} is done, at or after until_step = {until_step}", file=out)
        return state
    needed = 0 if "://" in config.checkpoints.checkpoints_path else checkpoint_bytes(state)
    _on_main(topology, lambda: check_room(str(directory), needed))
    _check_stages_ahead(config, schedule, state.step, tokenizer, out)
    report = Progress(schedule.train_steps, state.step, out, progress, config.logging.iteration_step_info_interval)
    stop = StopRequest(topology)
    loader, loader_index = None, None
    try:
        with stop.installed(), MetricsLog(directory / "metrics.jsonl", state.step, topology.is_main) as metrics_log, \
                TensorBoardLog(directory, state.step, topology.is_main, warn=report.message) as tensorboard_log:
            for step in range(state.step + 1, schedule.train_steps + 1):
                index = active_stage(schedule, step)
                if index != loader_index:
                    if loader is not None:
                        loader.close()  # free the finished stage's data before the next one loads
                    if topology.is_main:  # the fingerprint of the files as this stage reads them, not as at its save
                        fingerprints.of([schedule.stages[index].name])
                    loader, loader_index = open_stage(config, index, tokenizer, schedule, log=report.message), index
                    report.stage_started(schedule, index)
                state, metrics = train_step(state, loader.batch_at(step, topology.dp_rank, topology.dp))
                metrics["elapsed"] = round(report.elapsed(), 3)
                metrics_log.write(metrics)
                tensorboard_log.write(metrics)
                report.step_done(metrics)
                if until_step is not None and step >= until_step:
                    stop.requested = stop.requested or f"until_step = {until_step} (a planned stop, not a signal)"
                stopping = stop.agreed()
                if step % config.checkpoints.checkpoint_interval == 0 or step == schedule.train_steps or stopping:
                    report.message(f"saved step {step}: {save(state, fingerprints)}")
                if stopping and until_step is not None and step >= until_step:
                    report.message(f"stopped after step {step} of {schedule.train_steps} as asked (until_step = "
                                   f"{until_step}), schedule unchanged; run again without it, or with a later one, "
                                   "to go on from the checkpoint just saved")
                    break
                if stopping:
                    report.message(f"stopped by {stopping} after step {step} of {schedule.train_steps}; "
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
        report.message(f"done: {state.step} steps in {report.elapsed():.1f}s; metrics in {directory / 'metrics.jsonl'}")
    return state


def _check_stages_ahead(config: Config, schedule, completed: int, tokenizer, out: TextIO) -> None:
    """Open, and close again, the data of the current stage and of every later one this run reaches: a missing
    column, a short or truncated file or a wrong tokenizer there stops the run before its next step, not at the
    stage switch hours in, and the problems of all of them come in one error."""
    stages = [index for index in range(active_stage(schedule, completed + 1), len(schedule.stages))
              if stage_steps(schedule, index)]
    check_stages(config, stages, tokenizer, schedule, log=lambda message: print(message, file=out))


def save(state: TrainState, fingerprints: Fingerprints | None = None) -> str:
    fingerprint = None
    if state.topology.is_main:  # only rank 0 writes the metadata
        fingerprints = fingerprints or Fingerprints(state.config, load_run_tokenizer(state.config))
        fingerprint = fingerprints.of([s.name for s in begun_stages(state.schedule, state.step)])
    groups, info = checkpoint_blocks(state, fingerprint)
    checkpoints = state.config.checkpoints
    _on_main(state.topology, lambda: io.confirm_held(checkpoints.checkpoints_path))  # still ours: renewed now
    return io.save_checkpoint(checkpoints.checkpoints_path, state.step, groups, info, keep=checkpoints.keep,
                              topology=state.topology)


def start_state(config: Config, topology: Topology = SINGLE, *, fresh: bool = False,
                out: TextIO = sys.stdout, fingerprints: Fingerprints | None = None) -> TrainState:
    """A fresh state, or the one the checkpoint to resume from recorded, on this topology.

    resume_checkpoint_path, when set, must hold a committed checkpoint (never a silent fresh
    start); otherwise the run's own checkpoints_path is resumed from when it holds one, so
    rerunning the same command after a crash continues the run. `fresh` ignores both. Rank 0
    lists the checkpoints to try; every rank then reads, and checks, just the shards it holds. A
    checkpoint found damaged on any rank gives way, on all of them, to the next older intact one
    of a run folder (a step folder named on its own has none: its damage is the error).
    """
    checkpoints = config.checkpoints
    folders, failure = [], None
    if topology.is_main:
        try:
            folders = _checkpoints_to_try(config, fresh, out)
        except io.CheckpointError as e:
            failure = (isinstance(e, io.DamagedCheckpointError), str(e))
    failure, folders = broadcast_object((failure, folders), topology)
    if failure is not None:
        damaged, message = failure
        raise (io.DamagedCheckpointError if damaged else io.CheckpointError)(message)
    if not folders:
        return init_state(config, topology)
    fingerprints = fingerprints or Fingerprints(config, load_run_tokenizer(config))
    damaged = []
    for folder in folders:
        try:
            reader = read_on_every_rank(lambda: io.CheckpointReader(folder), topology)  # noqa: B023 - called now
            state = restore_state(config, reader, topology, load_optimizer=checkpoints.load_optimizer,
                                  load_lr_scheduler=checkpoints.load_lr_scheduler, fingerprints=fingerprints,
                                  log=lambda text: print(text, file=out))
            break
        except io.DamagedCheckpointError as e:
            if len(folders) == 1:
                raise
            damaged.append(str(e))
            if topology.is_main:
                print(f"warning: {folder} is damaged, trying an older checkpoint: {e}", file=out)
    else:
        raise io.DamagedCheckpointError("no checkpoint to resume from reads back intact: " + "; ".join(damaged))
    point = resume_point(state.schedule, TrainingMetadata.from_dict(reader.metadata["training"]))
    if state.step >= state.schedule.train_steps:
        print(f"nothing to do: {reader.path} has all {state.schedule.train_steps} steps done", file=out)
        return state
    skipped = [what for what, loaded in (("optimizer moments", checkpoints.load_optimizer),
                                         ("LR schedule position", checkpoints.load_lr_scheduler)) if not loaded]
    print(f"resuming from {reader.path}: step {state.step} done, next step {point.step} "
          f'(stage "{state.schedule.stages[point.stage].name}", {point.samples_in_stage} samples in)'
          + (f"; fresh {' and '.join(skipped)}" if skipped else ""), file=out)
    return state


def _checkpoints_to_try(config: Config, fresh: bool, out: TextIO) -> list[str]:
    """The step folders to resume from, in the order to try them; none for a fresh start."""
    checkpoints = config.checkpoints
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", io.CheckpointWarning)
        if fresh:
            folders = []
            _say_what_fresh_ignores(checkpoints, out)
        elif checkpoints.resume_checkpoint_path is not None and (own := _own_checkpoints(checkpoints)):
            # resume_checkpoint_path is where the run began (a branch from another run): once the run has committed
            # its own, rerunning the same command continues them instead of starting the branch over.
            folders = own
            print(f"checkpoints_path = {checkpoints.checkpoints_path} holds this run's own checkpoints: continuing "
                  f"them, not resume_checkpoint_path = {checkpoints.resume_checkpoint_path} (where the run began)",
                  file=out)
        elif checkpoints.resume_checkpoint_path is not None:
            folders = io.checkpoints_to_try(checkpoints.resume_checkpoint_path)
            if not folders:
                raise io.CheckpointError(
                    f"checkpoints.resume_checkpoint_path = {checkpoints.resume_checkpoint_path} holds no committed "
                    "checkpoint; refusing to start from scratch (unset it, or pass --fresh)")
        else:
            try:
                folders = io.checkpoints_to_try(checkpoints.checkpoints_path)
            except io.DamagedCheckpointError as e:
                raise io.DamagedCheckpointError(f"{e}\nRefusing to start from scratch over them: repair or move "
                                                "them, or pass --fresh") from None
    for warning in caught:
        print(f"warning: {warning.message}", file=out)
    return folders


def _own_checkpoints(checkpoints) -> list[str]:
    """The committed checkpoints of checkpoints_path when resume_checkpoint_path lies outside it, else none (a
    resume path inside the run's own folder rewinds the run to that step)."""
    own, start = checkpoints.checkpoints_path.rstrip("/"), checkpoints.resume_checkpoint_path.rstrip("/")
    if start == own or start.startswith(own + "/"):
        return []
    return io.checkpoints_to_try(own)


def _say_what_fresh_ignores(checkpoints, out: TextIO) -> None:
    """Name the committed checkpoints --fresh passes over, so that nobody takes a fresh start for a resume."""
    seen = set()
    for key in ("checkpoints_path", "resume_checkpoint_path"):
        where = getattr(checkpoints, key)
        if where is None or where in seen:
            continue
        seen.add(where)
        try:
            steps = sorted(int(folder.rstrip("/").rpartition("/")[2]) for folder in io.checkpoints_to_try(where))
        except Exception as e:  # noqa: BLE001 - only a message: what cannot be listed must not stop a fresh start
            print(f"--fresh: could not list checkpoints.{key} = {where} ({type(e).__name__}: {e})", file=out)
            continue
        if steps:
            print(f"--fresh: starting from step 1, ignoring the committed checkpoints of checkpoints.{key} = {where} "
                  f"(step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}); they are not deleted: a step is "
                  "replaced only when this run commits its own", file=out)


class StopRequest:
    """Ctrl-C, SIGTERM or SIGUSR1 ask the loop to stop after the current step; a second Ctrl-C stops at once.

    Under torchrun the ranks may see a signal at different steps, so they agree each step (one
    tiny all-reduce) and all stop, and save, after the same one.
    """

    def __init__(self, topology: Topology = SINGLE):
        self.requested: str | None = None
        self.topology = topology

    def agreed(self) -> str | None:
        if self.topology.mesh is None:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return (self.requested or "a signal to another rank") if flag.item() else None

    def _handle(self, signum, _frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def installed(self):
        stop = self

        class _Installed:
            def __enter__(self):
                self.previous = {s: signal.signal(s, stop._handle) for s in STOP_SIGNALS}

            def __exit__(self, *exc):
                for s, handler in self.previous.items():
                    signal.signal(s, handler)

        return _Installed()


class MetricsLog:
    """metrics.jsonl: one JSON object per step. Lines after `start_step` (from an abandoned attempt) are dropped.

    Written by rank 0 only (`enabled`); the metrics are global, the same on every rank.
    """

    def __init__(self, path: Path, start_step: int, enabled: bool = True):
        self.enabled = enabled
        self.file = None
        if not enabled:
            return
        try:
            with open(path, "a+b") as f:  # created when missing
                f.truncate(_kept_length(f, start_step))
        except OSError as e:
            raise RunFolderError(f"cannot write {path}: {e.strerror or e}") from None
        self.path = path

    def __enter__(self) -> MetricsLog:
        if self.enabled:
            self.file = open_for_append(self.path)
        return self

    def write(self, metrics: dict) -> None:
        if self.file is not None:
            try:
                self.file.write(json.dumps(metrics) + "\n")
                self.file.flush()
            except OSError as e:
                with contextlib.suppress(OSError):   # closing flushes the unwritten line again, into the same error
                    self.file.close()
                self.file = None
                raise RunFolderWriteError(
                    f"cannot write {self.path} after step {metrics['step']}: {e.strerror or e}; the checkpoints "
                    "committed before stand: make room and run the same command again to resume") from None

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()


def _kept_length(f, step: int, block: int = 1 << 16) -> int:
    """The byte length of metrics.jsonl up to the end of its last line of a step ≤ `step`.

    The lines are in step order (each run drops those after its start and appends), so this reads
    backwards from the end, only as far as the lines it drops: a resume late in a long run does not
    read the run's whole history. A line that does not parse (cut by a kill) counts as one to drop.
    """
    if step <= 0:
        return 0
    position = f.seek(0, os.SEEK_END)
    buffer, limit = b"", 0  # the file's bytes from `position` on; buffer[:limit] is what is still in question
    while True:
        end = buffer.rfind(b"\n", 0, limit)                # the newline ending the last line in question
        start = buffer.rfind(b"\n", 0, max(end, 0)) + 1    # where that line begins, if buffer reaches it
        if (end < 0 or start == 0) and position > 0:
            size = min(block, position)
            position -= size
            f.seek(position)
            buffer, limit = f.read(size) + buffer[:limit], limit + size
            continue
        if end < 0:
            return 0
        try:
            if json.loads(buffer[start:end])["step"] <= step:
                return position + end + 1
        except (ValueError, KeyError, TypeError):
            pass
        limit = start


class Progress:
    """A tqdm bar on a terminal; plain lines every logging interval elsewhere (CI logs, files)."""

    def __init__(self, train_steps: int, start_step: int, out: TextIO, live: bool | None, interval: int = 10):
        self.out, self.interval, self.train_steps, self.start_step = out, interval, train_steps, start_step
        self.start_time = self.last_time = time.perf_counter()
        self.step_time = 0.0  # time spent in steps (batch + train_step), not in loading a stage's data
        self.tokens = 0
        live = out.isatty() if live is None else live
        self.bar = None
        if live:
            from tqdm import tqdm
            self.bar = tqdm(total=train_steps, initial=start_step, file=out, unit="step", dynamic_ncols=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start_time

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    def stage_started(self, schedule, index: int) -> None:
        self.last_time = time.perf_counter()
        stage, steps = schedule.stages[index], stage_steps(schedule, index)
        self.message(f'stage "{stage.name}": steps {steps[0]}–{steps[-1]}, global batch {stage.global_batch_size}, '
                     f"sequence length {stage.sequence_length}")

    def step_done(self, m: dict) -> None:
        now = time.perf_counter()
        self.step_time += now - self.last_time
        self.last_time = now
        self.tokens += m["tokens"]
        rate = self.tokens / self.step_time
        if self.bar is not None:
            self.bar.set_description(m["stage"], refresh=False)
            self.bar.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}", tok_s=f"{rate:,.0f}", refresh=False)
            self.bar.update(1)
        elif m["step"] % self.interval == 0 or m["step"] == self.train_steps:
            remaining = (self.train_steps - m["step"]) * self.step_time / (m["step"] - self.start_step)
            print(f"step {m['step']:>{len(str(self.train_steps))}}/{self.train_steps}  {m['stage']:<12} "
                  f"loss {m['loss']:.4f}  lr {m['lr']:.2e}  grad {m['grad_norm']:.3f}  {rate:,.0f} tok/s  "
                  f"eta {remaining:.0f}s", file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
